"""megaprm: a Megatron-Core backend for RL of reasoning LLMs with process rewards."""
import warnings

# megatron-core announces its fallbacks at import on every machine without Apex/TE (all CPU
# runs): the local spec is the intended path there, so these lines are noise to users.
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed.*")
warnings.filterwarnings("ignore", message=r".*Apex is not installed.*")
# megatron-core 0.16 warns about a default it sets itself, once per process and model, and its
# dist_checkpointing calls torch APIs that torch 2.13 deprecates: nothing a user can act on
warnings.filterwarnings("ignore", message="full scope is deprecated")
warnings.filterwarnings("ignore", message="`load_state_dict` is deprecated", category=FutureWarning)
warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating "
                        "ShardedTensor", category=FutureWarning)

__version__ = "0.1.0"
