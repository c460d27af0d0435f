"""tokenselect: long-context LLM inference that attends only to the KV-cache tokens that matter."""

from .engine import LLM
from .errors import CheckpointError, ContextTooLong, KVPoolFull, TokenSelectError
from .sampling import SamplingParams
from .sequence import RequestOutput

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "TokenSelectError", "CheckpointError",
           "ContextTooLong", "KVPoolFull"]
