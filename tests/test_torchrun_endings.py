"""train/torchrun.py: the endings zerotune's workers ask for (stopped.json: exit 75; a handed-off user error:
exit 2) read as those endings whatever torchrun's agent raised on the way out, and every other failure keeps
torchrun's exception.

The agent's exceptions are raised by a stand-in for torch.distributed.run.main: the races that produce them on a
real cluster (another node's torchrun gone first: SIGTERM from srun, or its rendezvous store closed under this
agent's monitor loop) cannot be timed on purpose; test_slurm_cluster.py runs the real two-node ending."""

from __future__ import annotations

import pytest
import torch.distributed.run
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from zerotune.errors import EXIT_CODE, UserError
from zerotune.layout import RunLayout
from zerotune.stopping import REQUEUE_EXIT
from zerotune.train.handoff import StopRecord, hand_off
from zerotune.train.torchrun import run_torchrun

RAISED = {
    "child_failed": lambda: ChildFailedError("worker", {0: ProcessFailure(0, 1234, REQUEUE_EXIT, "<N/A>")}),
    "sigterm_from_srun": lambda: SignalException("SIGTERM", 15),
    "store_gone": lambda: RendezvousConnectionError("The connection to the C10d store has failed."),
}


def agent_raising(monkeypatch, name):
    def main(_argv):
        raise RAISED[name]()
    monkeypatch.setattr(torch.distributed.run, "main", main)


@pytest.mark.parametrize("name", sorted(RAISED))
def test_a_stop_the_workers_recorded_ends_with_exit_75(tmp_path, monkeypatch, name):
    agent_raising(monkeypatch, name)
    StopRecord(step=4, signal="SIGUSR1", checkpoint=str(tmp_path / "checkpoints/checkpoint-4"),
               committed=True).write(RunLayout(tmp_path).stopped)
    assert run_torchrun(tmp_path, []) == REQUEUE_EXIT


@pytest.mark.parametrize("name", sorted(RAISED))
def test_a_handed_off_user_error_ends_with_exit_2(tmp_path, monkeypatch, name):
    agent_raising(monkeypatch, name)
    run = RunLayout(tmp_path)
    run.train.mkdir(parents=True, exist_ok=True)
    hand_off(run.train, UserError("recipes/x.yaml: rl.reward: my_rewards.score raised ValueError"))
    assert run_torchrun(tmp_path, []) == EXIT_CODE


@pytest.mark.parametrize("name", sorted(RAISED))
def test_any_other_failure_keeps_torchruns_exception(tmp_path, monkeypatch, name):
    agent_raising(monkeypatch, name)
    with pytest.raises(type(RAISED[name]())):
        run_torchrun(tmp_path, [])
