import subprocess
import sys


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "prime_train.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_missing_config_is_one_clear_line(tmp_path):
    missing = tmp_path / "nope.toml"
    r = run_cli("--config", str(missing))
    assert r.returncode == 2
    assert str(missing) in r.stderr
    assert "Traceback" not in r.stderr
