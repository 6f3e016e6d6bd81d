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
