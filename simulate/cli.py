"""``vlmshard simulate``: a plan's epoch on a simulated cluster, the packing strategies and
OmniBal's three levers side by side, and the simulator checked against a measured run."""

from __future__ import annotations

from vlmshard.stage import stage_command

from .config import SimulateConfig

DESCRIPTION = """\
Simulates one epoch of PLAN_DIR on PP x DP GPUs: every data-parallel replica runs its
micro-batches of each step through a 1F1B pipeline whose stage times come from the model's
per-layer FLOPs for that micro-batch (tiles, tokens, squared lengths) at --mfu of the GPU's peak,
with the searched stage partition and per-stage recompute that fit the GPU's memory (ZeRO-1
optimizer states). The step waits for the slowest replica. Micro-batches are costed as the
trainer executes them in --compute-mode (default: the plan's): padding-free on their real tiles
and tokens, padded on all Qv tiles and Qt tokens (each packing's own caps) with attention over
the real samples. Reports time, GPU-days, the pipeline bubble fraction and the data-parallel
waiting fraction, then:

  strategies  the same samples packed random / lengthgroup / isf / balanced, each simulated
  levers      OmniBal's ablation: baseline (random data, DeepSpeed 'parameters' partition, full
              recompute) -> + data balance -> + model balance (searched partition) -> + memory
              balance (adaptive recompute), next to OmniBal's published A100 GPU-days

--train-log RUN/train_log.jsonl --profile PROFILE_DIR checks the simulator against a real run:
each logged step is re-simulated from its logged micro-batch sizes with the profile's measured
layer times and the run's own partition, and the error against the measured step time is
reported (PLAN_DIR is then optional)."""


add_arguments, main = stage_command("simulate", SimulateConfig,
                                    "vlmshard.simulate.runs:run_simulate")
