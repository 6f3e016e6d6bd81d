"""What a user reads when a command line or a source is wrong: global flags anywhere, the
command's own usage on a bad flag, required options named as typed, and rejects that say what to
pass."""

from __future__ import annotations

import json

import pytest

from vlmshard.cli import main
from vlmshard.preprocess import NothingAccepted, PreprocessConfig, run_preprocess
from vlmshard.preprocess.conversation import RowFormat, parse_conversation
from vlmshard.rejects import Reject
from vlmshard.stage import one_line


def _run(capsys, *argv: str) -> tuple[int, str]:
    """``vlmshard ARGV`` in this process: its exit status and stderr."""
    try:
        status = main(list(argv))
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err


@pytest.mark.parametrize("flag", ["-q", "--quiet", "-v", "--verbose"])
def test_a_global_flag_after_the_command(capsys, tmp_path, flag):
    """Typed after the command's name, a global flag is taken (the run then fails on its
    missing input, not on its flags); typed before it, too."""
    missing = str(tmp_path / "none.jsonl")
    for argv in (["preprocess", missing, "--out", str(tmp_path / "o"), flag],
                 [flag, "preprocess", missing, "--out", str(tmp_path / "o")]):
        status, err = _run(capsys, *argv)
        assert status == 1, err
        assert err.splitlines()[-1] == f"vlmshard preprocess: error: input not found: {missing}"


def test_an_unknown_flag_shows_the_command_usage(capsys):
    status, err = _run(capsys, "preprocess", "--model", "m", "--inputs", "meta.json",
                       "--out", "pre")
    assert status == 2
    assert err.startswith("usage: vlmshard preprocess "), err
    assert err.splitlines()[-1] == "vlmshard preprocess: error: unrecognized arguments: --inputs"
    status, err = _run(capsys, "train", "profile", "--shards", "s", "--bogus", "1")
    assert status == 2 and err.startswith("usage: vlmshard train profile "), err
    assert err.splitlines()[-1].endswith("error: unrecognized arguments: --bogus 1")


def test_a_missing_option_is_named_as_typed(capsys):
    status, err = _run(capsys, "pack", "--dp", "2")
    assert status == 1
    assert err.splitlines()[-1] == ("vlmshard pack: error: missing required option(s) --stats, "
                                    "--out: pass them on the command line or in a --config file")


def test_a_missing_positional_is_not_called_an_option(capsys):
    status, err = _run(capsys, "verify", "--quick")
    assert status == 1
    assert err.splitlines()[-1] == ("vlmshard verify: error: missing required argument SHARDS: "
                                    "pass them on the command line or in a --config file")


def test_an_image_count_mismatch_counts_placeholders_and_images():
    row = {"messages": [{"role": "user", "content": "<image>What?"},
                        {"role": "assistant", "content": "A cat."}],
           "images": ["a.png", "b.png"]}
    with pytest.raises(Reject) as e:
        parse_conversation(row, RowFormat())
    assert (e.value.reason, e.value.message) == (
        "image_count_mismatch", "1 placeholder, 2 images in the images column")


def test_a_source_of_unknown_roles_hints_the_mapping(tmp_path):
    """Every row rejected as bad_role: the error names the role and the --roles that reads it;
    that mapping then accepts every row."""
    rows = [{"conversations": [{"from": "human", "value": f"Question {i}?"},
                               {"from": "bot", "value": f"Answer {i}."}]} for i in range(3)]
    path = tmp_path / "bots.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(NothingAccepted) as e:
        run_preprocess(PreprocessConfig(inputs=[str(path)], out=str(tmp_path / "a"), workers=1))
    assert ("all 3 row(s) rejected as bad_role: turns have role 'bot', which is not user, "
            "assistant or system: map it with --roles bot=assistant;") in str(e.value)
    result = run_preprocess(PreprocessConfig(inputs=[str(path)], out=str(tmp_path / "b"),
                                             workers=1, roles=["bot=assistant"]))
    assert (result.accepted, result.rejected) == (3, 0)


def test_a_json_file_that_does_not_parse_is_one_line_naming_where(tmp_path):
    """A JSON file with a syntax error (a missing comma on line 2): the job's one-line error
    names the file, the line and the column, not only the rejects file."""
    path = tmp_path / "broken.json"
    path.write_text('[{"conversations": [{"from": "human", "value": "Hi"}]},\n'
                    ' {"conversations": [{"from": "human" "value": "x"}]}]\n')
    with pytest.raises(NothingAccepted) as e:
        run_preprocess(PreprocessConfig(inputs=[str(path)], out=str(tmp_path / "out"),
                                        workers=1))
    assert (f"all 1 row(s) rejected as unreadable_source: {path} is not valid JSON: "
            "Expecting ',' delimiter: line 2 column 38") in str(e.value)


def test_quiet_prints_a_stages_one_line_not_its_table(capsys, demo_out, tmp_path):
    """``-q``: the stage's one line (the one ``vlmshard run`` prints for it), not the table its
    command prints otherwise; without it, the table and the same line's figures."""
    plan = tmp_path / "plan"
    assert main(["-q", "pack", "--stats", str(demo_out), "--dp", "2", "--out", str(plan)]) == 0
    quiet = capsys.readouterr().out
    assert main(["pack", "--stats", str(demo_out), "--dp", "2", "--out", str(plan)]) == 0
    table = capsys.readouterr().out
    steps = json.loads((plan / "plan.json").read_text())["metrics"]["steps"]
    assert quiet.count("\n") == 1 and quiet.endswith(f"-> {plan}\n") and f" {steps} steps" in quiet
    assert "step_efficiency" in table and "step_efficiency" not in quiet


def test_quiet_leaves_out_deepspeeds_cpu_notice_and_hugging_faces_bars():
    """A process logging at ``-q``'s level imports DeepSpeed without its warning that it found no
    GPU (a ``vlmshard run``'s model stage imports it), and Hugging Face's libraries, imported
    after, draw no progress bars."""
    import os
    import subprocess
    import sys

    from vlmshard.process import QUIET_PROGRESS

    code = ("import os\n"
            "from vlmshard.process import QUIET_PROGRESS, set_up_logging\n"
            "set_up_logging('WARNING')\n"
            "import deepspeed\n"
            "print(*(os.environ[name] for name in QUIET_PROGRESS))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", *QUIET_PROGRESS)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env=env)
    assert (proc.stdout, proc.stderr) == ("1 1\n", "")


def test_the_command_line_exits_without_collecting_what_is_alive():
    """``vlmshard`` freezes the objects alive at its exit (``vlmshard.process``), once however
    often ``main`` runs: an exit handler registered before the command, so called after its
    handler, finds them frozen."""
    import subprocess
    import sys

    code = ("import atexit, gc\n"
            "freeze = gc.freeze\n"
            "gc.freeze = lambda: (print('freeze'), freeze())\n"
            "atexit.register(lambda: print('frozen', gc.get_freeze_count()))\n"
            "from vlmshard.cli import main\n"
            "for _ in range(3):\n"
            "    try:\n"
            "        main(['--version'])\n"
            "    except SystemExit:\n"
            "        pass\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out.count("freeze") == 1 and out[-2] == "frozen" and int(out[-1]) > 1000, out


def test_a_path_option_given_a_folder_a_missing_path_or_an_unreadable_file_is_one_line(
        tmp_path):
    """Where a run's or a profile's file is expected, its folder is taken (the file inside it
    found), and a folder without it or a missing path is one line naming the option; an
    operating system's error on a path is the path and its reason, never a raw ``[Errno N]``
    (as root, this machine's tests cannot make a file unreadable: ``one_line`` is held to
    one directly)."""
    import os

    from helpers import vlmshard

    data = os.path.join(os.path.dirname(__file__), "data", "omnibal", "meta.json")
    plan = tmp_path / "plan"
    vlmshard("pack", "--stats", data, "--dp", "2", "--out", str(plan))
    empty = tmp_path / "empty"
    empty.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_log.jsonl").write_text("{}\n")
    profile = tmp_path / "profile"
    profile.mkdir()
    (profile / "cost_model.json").write_text('{"a_v": 1.0, "a_t": 2.0, "b": 0.0}')
    (profile / "profile.json").write_text("{}")
    cases = {  # the command's words before the path, and what the line must name
        "pack --cost-model": (["pack", "--stats", data, "--dp", "2", "--out",
                               str(tmp_path / "p2"), "--cost-model"], "--cost-model"),
        "report --train-log": (["report", str(plan), "--train-log"], "--train-log"),
        "simulate --profile": (["simulate", "--train-log", str(run), "--profile"],
                               "--profile"),
    }
    for name, (words, option) in cases.items():
        for path, says in ((empty, "the folder holds no"), (tmp_path / "missing",
                                                            "no such file or folder")):
            result = vlmshard(*words, str(path), check=False)
            error = result.stderr.strip().splitlines()[-1]
            assert result.returncode == 1 and "[Errno" not in result.stderr, (name, path)
            assert says in error and option in error, (name, error)
    assert one_line(IsADirectoryError(21, "Is a directory", "run")) == "run: Is a directory"
    assert one_line(PermissionError(13, "Permission denied", "a.json")) == \
        "a.json: Permission denied"
    # a profile's folder where its cost_model.json is asked for: taken as that file
    vlmshard("pack", "--stats", data, "--dp", "2", "--out", str(tmp_path / "p3"),
             "--cost-model", str(profile))
    # a profile.json where the profile's folder is asked for, a run folder without a log
    result = vlmshard("report", str(plan), "--train-log", str(empty), "--profile",
                      str(profile / "profile.json"), check=False)
    assert "--train-log" in result.stderr and "[Errno" not in result.stderr
