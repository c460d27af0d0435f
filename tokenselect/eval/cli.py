"""``tokenselect eval``: long-context tasks x lengths x attention policies on one model."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..models.registry import MODEL_HELP
from ..policies import POLICIES, add_policy_args
from .runner import run
from .tasks import TASKS

DESCRIPTION = """\
Run a model over long-context tasks generated offline from --seed (InfiniteBench passkey,
number_string, kv_retrieval; RULER niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue,
niah_multiquery, vt, cwe, fwe), with several attention policies side by side on the same prompts.
Writes to --output: predictions.jsonl and predictions.csv (every sample and policy), summary.json
(mean score x 100 per policy, task and length) and PNG plots (depth x length heatmaps for needle
tasks, score vs length per task); prints the table in markdown.

Lengths are in the model's tokens: 4k (4096), 1m, a plain number, or multiples of the model's
trained window: 1x, 4x, 16x. Needle depths are spread evenly over the --samples of each cell.
--chat on wraps each prompt in the model's chat template (the context and question as the user's
turn, the task's answer prefix opening the assistant's); --chat off gives the plain prompt; auto
(the default) is on for a model whose tokenizer has a chat template. The results record which ran. A policy written NAME@SCALING runs on its own engine with that
RoPE scaling, e.g. full@dynamic:4 for full attention with dynamic NTK. Policy flags apply to every
policy that takes them.

Stopping: Ctrl-C or SIGTERM (e.g. `timeout`) ends the run at the next engine step and writes every
output from the samples it finished (exit code 130; a second signal stops at once). predictions.jsonl
gets a line as each sample finishes, so a killed run keeps its answers too, and the same command with
--resume generates only the samples it lacks (run.json keeps the settings they were made with).

example:
  tokenselect eval --task passkey,kv_retrieval --lengths 1x,4x --samples 5 \\
      --attention full,full@dynamic:4,streaming,tokenselect --output runs/eval
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``eval`` command to the ``tokenselect`` subparsers."""
    p = subparsers.add_parser("eval", help="score attention policies on long-context tasks (InfiniteBench, RULER)",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help=f"{MODEL_HELP}; default: the model that ships with tokenselect")
    p.add_argument("--chat", choices=("auto", "on", "off"), default="auto",
                   help="wrap prompts in the model's chat template (default auto: on where it has one)")
    p.add_argument("--task", default="passkey", help=f"comma list of tasks (default passkey): {', '.join(TASKS)}")
    p.add_argument("--lengths", default="1x,4x", help="comma list of context lengths: 4k, 16k, 5000, 1x, 4x (default 1x,4x)")
    p.add_argument("--samples", type=int, default=5, help="samples per task and length, depths spread evenly (default 5)")
    p.add_argument("--attention", default="full,streaming,tokenselect",
                   help=f"comma list of policies ({', '.join(sorted(POLICIES))}), each optionally @SCALING "
                        "(default full,streaming,tokenselect)")
    p.add_argument("--output", type=Path, default=Path("eval_results"), help="output folder (default eval_results)")
    p.add_argument("--seed", type=int, default=0, help="seed of every sample (default 0)")
    p.add_argument("--prompt-cache", default=None,
                   help="folder where built prompts are kept and reused by later runs and other processes "
                        "(default $TOKENSELECT_HOME/eval-prompts; 'none' to build them afresh)")
    p.add_argument("--workers", type=int, default=None,
                   help="processes that build the prompts (default: the CPU count, at most 16)")
    p.add_argument("--backend", choices=("engine", "transformers"), default="engine",
                   help="engine (default): our engine; transformers: the model through transformers with the "
                        "tokenselect.hf attention backend (every policy; no @SCALING)")
    p.add_argument("--resume", action="store_true",
                   help="go on from the answers already in --output (a stopped or killed run): those to this run's "
                        "prompts are kept, the rest are generated; the settings must be the earlier run's "
                        "(checked against its run.json)")
    p.add_argument("--prompts-only", action="store_true",
                   help="build the prompts into the prompt cache and stop (for several eval processes to share)")
    add_policy_args(p)
    p.set_defaults(func=run)
    return p
