import json

from typer.testing import CliRunner

from tiertune.cli.app import app

runner = CliRunner()


def test_env_reports_versions_memory_and_disk(tmp_path):
    result = runner.invoke(app, ["env", "--disk-path", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["packages"]["torch"].startswith("2.")
    assert set(info["packages"]) >= {"torch", "bitsandbytes", "peft", "transformers", "accelerate"}
    assert info["ram_total_bytes"] > 0 and info["cpu_count"] >= 1
    assert info["compute_device"] in ("cpu", "cuda")
    assert info["disk"]["free_bytes"] > 0 and info["disk"]["o_direct"] in (True, False)


def test_env_table_is_readable(tmp_path):
    result = runner.invoke(app, ["env", "--disk-path", str(tmp_path)])
    assert result.exit_code == 0
    for label in ("torch", "ram", "compute device", "disk free", "O_DIRECT"):
        assert label in result.output


def test_env_bad_disk_path_is_a_usage_error(tmp_path):
    result = runner.invoke(app, ["env", "--disk-path", str(tmp_path / "missing")], env={"COLUMNS": "400"})
    assert result.exit_code == 2
    assert "not an existing directory" in result.output
    assert "Traceback" not in result.output


def test_help_has_an_example():
    result = runner.invoke(app, ["env", "--help"])
    assert result.exit_code == 0 and "Example: tiertune env" in result.output


def test_demo_runs_a_fine_tune_with_states_on_disk(tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    result = runner.invoke(app, ["demo", "--workdir", str(tmp_path), "--steps", "4"])
    assert result.exit_code == 0, result.output
    assert "done: 4 steps" in result.output
    log = [json.loads(line) for line in (tmp_path / "out" / "trainer_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 4 and log[-1]["bytes_moved"]["host->disk"] > 0
    AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # the output loads with transformers


def test_env_probe_measures_the_disk(tmp_path):
    import json

    result = CliRunner().invoke(app, ["env", "--disk-path", str(tmp_path), "--probe", "--json"])
    assert result.exit_code == 0, result.output
    disk = json.loads(result.stdout)["disk"]
    assert disk["read_bytes_per_second"] > 1e6 and disk["write_bytes_per_second"] > 1e6
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing behind
    assert CliRunner().invoke(app, ["env", "--probe"]).exit_code == 2


def test_version_is_printed():
    from importlib import metadata

    for flag in ("--version", "-V"):
        result = runner.invoke(app, [flag])
        assert result.exit_code == 0, result.output
        assert result.output.strip() == f"tiertune {metadata.version('tiertune')}"
