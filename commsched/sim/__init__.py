"""The schedule simulator: replay the scheduler's policy on a model of one iteration.

Modules, in data-flow order::

    profile.py    recorded run (telemetry) -> iteration profiles: requests, readiness,
                  backward end, the rest of the compute; the run's configuration
    model.py      collective cost models: alpha-beta fitted on a run's chunks, or
                  ring / tree / hierarchical formulas for clusters never measured
    engine.py     discrete-event replay: partition, plan / fifo order, credit window,
                  serial link per lane -> predicted iteration time and exposed comm
    tune.py       search of (partition, credit, decomposition) on the engine
    whatif.py     ``commsched simulate RUN_DIR --world-size N --bandwidth GBPS``
    validate.py   ``python -m commsched.sim.validate RUN_DIR...``: predicted vs measured

Example::

    run = commsched.sim.load_recorded_run("runs/gpt")
    model = commsched.sim.fit_cost_model(run.fit_rows)
    print(commsched.sim.simulate(run.representative(), model, run.sim_config()).iteration_s)
"""

from __future__ import annotations

from .engine import (IterationProfile, SimConfig, SimRequest, SimResult, StepTiming,
                     chunk_bytes, simulate)
from .model import (AlphaBeta, FittedCostModel, SimError, TopologyCostModel, fit_alpha_beta,
                    fit_cost_model)
from .profile import RecordedRun, load_recorded_run, representative_profile
from .tune import default_candidates, tune

__all__ = [
    "IterationProfile", "SimConfig", "SimRequest", "SimResult", "StepTiming", "chunk_bytes",
    "simulate", "AlphaBeta", "FittedCostModel", "SimError", "TopologyCostModel",
    "fit_alpha_beta", "fit_cost_model", "RecordedRun", "load_recorded_run",
    "representative_profile", "default_candidates", "tune", "simulate_main",
]


def simulate_main(argv=None) -> int:
    """``commsched simulate RUN_DIR ...`` (see :mod:`commsched.sim.whatif`)."""
    from .whatif import simulate_main as main
    return main(argv)
