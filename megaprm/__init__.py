"""megaprm: a Megatron-Core backend for RL of reasoning LLMs with process rewards."""
import warnings

# megatron-core announces its fallbacks at import on every machine without Apex/TE (all CPU
# runs): the local spec is the intended path there, so these lines are noise to users.
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed.*")
warnings.filterwarnings("ignore", message=r".*Apex is not installed.*")

__version__ = "0.1.0"
