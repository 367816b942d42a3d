"""edurl: reinforcement learning for large language models, learned by building it.

The notebooks in ``notebooks/`` import everything they run from here:

- ``edurl.device()`` and ``edurl.seed_everything()``: where to run and how to repeat a run.
- ``edurl.MetricsLogger`` and ``edurl.load_metrics()``: ``metrics.jsonl``, one JSON object per step.
- ``edurl.plotting``: learning curves over seeds, value heatmaps.
- ``edurl.rl``: returns, tabular dynamic programming, and the classic algorithms.
- ``edurl.exercises``: checkers for the notebooks' exercises and their worked solutions.
"""

from edurl.metrics import MetricsLogger, load_metrics
from edurl.utils import cpu_threads, device, seed_everything, torch_threads

__version__ = "0.1.0"
__all__ = ["device", "seed_everything", "cpu_threads", "torch_threads", "MetricsLogger", "load_metrics", "__version__"]
