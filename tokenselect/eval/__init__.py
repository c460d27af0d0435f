"""Long-context evaluation: InfiniteBench retrieval and RULER synthetic tasks, generated from a seed.

``tasks`` builds prompts of a given length in the model's tokens, ``metrics`` scores answers as the
benchmarks do, ``runner`` runs tasks x lengths x policies, ``plots`` draws the figures and ``cli``
adds the ``tokenselect eval`` command.
"""

from .metrics import score
from .tasks import TASKS, Sample, make_sample

__all__ = ["TASKS", "Sample", "make_sample", "score"]
