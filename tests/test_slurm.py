"""sbatch scripts: valid bash, placeholders marked, and they run the same CLI the tests run."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SLURM = Path(__file__).resolve().parents[1] / "slurm"
SCRIPTS = sorted(SLURM.glob("*.sbatch")) + [SLURM / "env.sh"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script):
    if shutil.which("shellcheck") is None:
        if os.environ.get("CI"):  # .ci/run installs it: missing there is a failure, not a skip
            pytest.fail("shellcheck missing in CI")
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    subprocess.run(["shellcheck", "-x", "-s", "bash", str(script)], check=True, cwd=SLURM.parent)


def test_finetune_runs_the_zerotune_cli_and_never_parses_yaml():
    text = (SLURM / "finetune.sbatch").read_text()
    assert re.search(r"-m torch\.distributed\.run .*\n(.*\n)*\s+-m zerotune train \"\$RECIPE\"", text)
    assert "zerotune plan" in text  # preflight
    for banned in ("yq ", "grep ", "awk ", ".yaml"):
        assert banned not in text.replace("# ", ""), banned


@pytest.mark.parametrize("script", sorted(SLURM.glob("*.sbatch")), ids=lambda p: p.name)
def test_site_specific_values_are_marked_placeholders(script):
    text = script.read_text()
    assert "#SBATCH --account=PLACEHOLDER_ACCOUNT" in text
    assert "source slurm/env.sh" in text
