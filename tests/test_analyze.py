"""``ess-patch analyze`` on hand-built dumps in the documented layouts, and its bad input.

The real frameworks' writers are exercised in tests/frameworks/test_analyze_dumps.py; here
the layouts are built by hand (per-rank CP-local miles files, slime's gathered format 2) so
the reader, the CP reassembly and every refusal run without the snapshots.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from analyze_data import SIGMAS, check_against_reference, make_rollout, save_slime_dump

from ess_patch.analyze import DumpError, analyze
from ess_patch.cli import main


def zigzag_indices(total: int, resp: int, cp_rank: int, cp: int) -> list[int]:
    """Response indices rank cp_rank holds, written out from the zigzag rule independently."""
    chunk = math.ceil(total / (2 * cp))
    prompt = total - resp
    idx = []
    for c in (cp_rank, 2 * cp - 1 - cp_rank):
        for logit in range(c * chunk, min((c + 1) * chunk, total)):
            token = logit + 1  # logit at position p scores token p + 1
            if prompt <= token < total:
                idx.append(token - prompt)
    return idx


def write_per_rank(folder: Path, rid: int, samples: list[dict], *, dp=2, cp=2, legacy=False):
    folder.mkdir(parents=True, exist_ok=True)
    for dp_rank in range(dp):
        mine = [s for i, s in enumerate(samples) if i % dp == dp_rank]
        for cp_rank in range(cp):
            rank = dp_rank * cp + cp_rank
            sl = [zigzag_indices(s["total"], s["resp"], cp_rank, cp) for s in mine]
            data = {
                "log_probs": [s["lp"][i] for s, i in zip(mine, sl, strict=True)],
                "rollout_log_probs": [s["rlp"][i] for s, i in zip(mine, sl, strict=True)],
                "loss_masks": [s["mask"] for s in mine],
                "total_lengths": [s["total"] for s in mine],
                "response_lengths": [s["resp"] for s in mine],
            }
            payload = {"rollout_id": rid, "rank": rank, "rollout_data": data}
            if not legacy:
                payload |= {"cp_rank": cp_rank, "cp_size": cp, "qkv_format": "thd"}
            torch.save(payload, folder / f"{rid}_{rank}.pt")


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "train_data"
    for rid, sigma in enumerate(SIGMAS):
        write_per_rank(d, rid, make_rollout(rid, sigma))
    return d


def test_per_rank_cp2_dp2_matches_the_float64_reference(run_dir, tmp_path):
    out = tmp_path / "out"
    result = analyze([run_dir], out)
    rollouts = [make_rollout(r, s) for r, s in enumerate(SIGMAS)]
    check_against_reference(result.rows, rollouts)
    with (out / "per_rollout.csv").open() as f:
        check_against_reference(list(csv.DictReader(f)), rollouts)  # the CSV, read back
    summary = json.loads((out / "summary.json").read_text())
    prod = next(s for s in summary if s["setting"] == "product/linear/floor=0.1")
    scales = [
        r["scale"]
        for r in result.rows
        if r["weight_mode"] == "product" and r["rule"] == "linear" and r["floor"] == 0.1
    ]
    assert prod["mean_scale"] == pytest.approx(sum(scales) / len(scales))
    assert prod["braked"] == sum(s < 1 for s in scales) >= 2  # the drift brakes: a real check
    assert prod["worst_rollouts"][0][1] == min(scales)
    assert (out / "analyze.png").stat().st_size > 10_000
    assert "mean scale" in (out / "summary.md").read_text()


def test_slime_gathered_format_matches_the_reference(tmp_path):
    d = tmp_path / "slime"
    d.mkdir()
    rollouts = [make_rollout(r, s) for r, s in enumerate(SIGMAS)]
    for rid, samples in enumerate(rollouts):
        save_slime_dump(d / f"{rid}_0.pt", rid, samples)
    result = analyze([d], tmp_path / "out", figure=False)
    check_against_reference(result.rows, rollouts)


def test_legacy_cp1_dump_without_cp_fields_is_read(tmp_path):
    d = tmp_path / "old"
    write_per_rank(d, 0, make_rollout(0, 0.3), dp=2, cp=1, legacy=True)
    result = analyze([d], tmp_path / "out", figure=False)
    check_against_reference(result.rows, [make_rollout(0, 0.3)])


def test_tensor_parallel_copies_count_once(run_dir, tmp_path):
    # A TP peer dumps the same values under another rank: shift every rank up by 4.
    for f in sorted(run_dir.glob("*.pt")):
        obj = torch.load(f, weights_only=True)
        obj["rank"] += 4
        torch.save(obj, run_dir / f"{obj['rollout_id']}_{obj['rank']}.pt")
    result = analyze([run_dir], tmp_path / "out", figure=False)
    check_against_reference(result.rows, [make_rollout(r, s) for r, s in enumerate(SIGMAS)])


# --- bad input: clear message, exit 1, nothing written -----------------------------------------


def cli_error(capsys, *argv) -> str:
    assert main(["analyze", *map(str, argv), "--no-progress"]) == 1
    return capsys.readouterr().err


def test_missing_cp_slice(run_dir, tmp_path, capsys):
    (run_dir / "2_3.pt").unlink()  # dp rank 1, cp rank 1 of rollout 2
    err = cli_error(capsys, run_dir, "--out", tmp_path / "out")
    assert "rollout 2" in err and "cp_rank=[1]" in err and "rank(s) [2]" in err
    assert not (tmp_path / "out").exists()


def test_missing_rank_with_cp1(tmp_path, capsys):
    d = tmp_path / "d"
    for rid in range(3):
        write_per_rank(d, rid, make_rollout(rid, 0.1), dp=2, cp=1)
    (d / "1_1.pt").unlink()
    err = cli_error(capsys, d, "--out", tmp_path / "out")
    assert "rollout 1" in err and "missing rank(s) [1]" in err


def test_mixed_runs(run_dir, tmp_path, capsys):
    other = tmp_path / "other"
    write_per_rank(other, 0, make_rollout(0, 0.5))
    err = cli_error(capsys, run_dir, other, "--out", tmp_path / "out")
    assert "rank 0 appears twice" in err and "mixed runs" in err
    cp1 = tmp_path / "cp1"
    write_per_rank(cp1, 9, make_rollout(9, 0.5), cp=1)
    err = cli_error(capsys, run_dir, cp1, "--out", tmp_path / "out")
    assert "rollout 9" in err and "cp_size=1" in err and "mixed runs" in err


def test_no_train_log_probs_names_the_flag(tmp_path, capsys):
    d = tmp_path / "d"
    write_per_rank(d, 0, make_rollout(0, 0.1), cp=1)
    for f in d.glob("*.pt"):
        obj = torch.load(f, weights_only=True)
        del obj["rollout_data"]["log_probs"]
        torch.save(obj, f)
    err = cli_error(capsys, d, "--out", tmp_path / "out")
    assert "no train log-probs" in err and "--save-debug-train-data" in err
    assert "--use-rollout-logprobs" in err


def test_rollout_only_dump(tmp_path, capsys):
    d = tmp_path / "rollout_data"
    d.mkdir()
    torch.save({"rollout_id": 0, "samples": [{"tokens": [1, 2], "reward": 1.0}]}, d / "0.pt")
    err = cli_error(capsys, d, "--out", tmp_path / "out")
    assert "--save-debug-rollout-data" in err and "no train log-probs" in err


def test_truncated_and_foreign_files(run_dir, tmp_path, capsys):
    f = run_dir / "1_0.pt"
    f.write_bytes(f.read_bytes()[:200])
    err = cli_error(capsys, run_dir, "--out", tmp_path / "out")
    assert "1_0.pt" in err and "truncated or foreign" in err
    g = tmp_path / "g"
    g.mkdir()
    (g / "0_0.pt").write_text("not a torch file")
    assert "truncated or foreign" in cli_error(capsys, g, "--out", tmp_path / "out")
    torch.save([1, 2, 3], g / "0_0.pt")
    assert "not a train-data dump" in cli_error(capsys, g, "--out", tmp_path / "out")


class Evil:
    def __reduce__(self):
        return (Path.touch, (Path("/tmp/ess-analyze-evil"),))


def test_pickled_objects_are_refused_not_run(tmp_path, capsys):
    marker = Path("/tmp/ess-analyze-evil")
    marker.unlink(missing_ok=True)
    g = tmp_path / "g"
    g.mkdir()
    torch.save({"rollout_id": 0, "rank": 0, "rollout_data": {"x": Evil()}}, g / "0_0.pt")
    err = cli_error(capsys, g, "--out", tmp_path / "out")
    assert "weights_only" in err and not marker.exists()


def test_writes_only_into_out_and_never_through_a_symlink(run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (out / "summary.md").symlink_to(victim)
    err = cli_error(capsys, run_dir, "--out", out)
    assert "summary.md" in err and victim.read_text() == "keep"
    (out / "summary.md").unlink()
    assert (
        main(["analyze", str(run_dir), "--out", str(out), "--no-progress", "--floor", "0.2"]) == 0
    )
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["per_rollout.csv", "summary.md", "summary.json", "analyze.png"]
    )
    assert "product/sqrt/floor=0.2" in capsys.readouterr().out


def test_bad_settings_exit_2(run_dir, tmp_path, capsys):
    assert main(["analyze", str(run_dir), "--out", str(tmp_path / "o"), "--floor", "0"]) == 2
    assert "floor" in capsys.readouterr().err


def test_analyze_raises_dump_error_for_an_empty_folder(tmp_path):
    with pytest.raises(DumpError, match=r"no \.pt dump files"):
        analyze([tmp_path], tmp_path / "out")


# --- malformed but readable dumps: one line naming the file and the field, exit 1 -------------


def _mutate(path: Path, change) -> None:
    obj = torch.load(path, weights_only=True)
    change(obj)
    torch.save(obj, path)


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _set(key, value):
    return lambda obj: obj["rollout_data"][key].__setitem__(0, value)


MALFORMED = {
    "rollout_id_pair": (lambda o: o.__setitem__("rollout_id", [1, 2]), "'rollout_id'"),
    "rollout_id_tensor_pair": (
        lambda o: o.__setitem__("rollout_id", torch.tensor([1, 2])),
        "'rollout_id'",
    ),
    "string_length": (_set("total_lengths", "12"), "sample 0: 'total_lengths'"),
    "none_length": (_set("response_lengths", None), "sample 0: 'response_lengths'"),
    "float_length": (_set("response_lengths", 3.0), "sample 0: 'response_lengths'"),
    "negative_length": (_set("response_lengths", -1), "sample 0: 'response_lengths'"),
    "integer_log_probs": (
        lambda o: o["rollout_data"]["log_probs"].__setitem__(
            0, o["rollout_data"]["log_probs"][0].to(torch.int64)
        ),
        "sample 0: 'log_probs' has dtype torch.int64",
    ),
    "complex_mask": (
        lambda o: o["rollout_data"]["loss_masks"].__setitem__(
            0, o["rollout_data"]["loss_masks"][0].to(torch.complex64)
        ),
        "sample 0: 'loss_masks' has dtype torch.complex64",
    ),
    "non_tensor_sample": (_set("rollout_log_probs", [0.1, 0.2]), "sample 0: 'rollout_log_probs'"),
    "non_list_column": (
        lambda o: o["rollout_data"].__setitem__("log_probs", 5),
        "'log_probs' is 5, expected a list",
    ),
    "tensor_column": (
        lambda o: o["rollout_data"].__setitem__("loss_masks", torch.ones(8, 3)),
        "'loss_masks' is a torch.float32 tensor of shape (8, 3)",
    ),
    "huge_cp_size": (lambda o: o.__setitem__("cp_size", 10**12), "'cp_size' is 1000000000000"),
    "zero_cp_size": (lambda o: o.__setitem__("cp_size", 0), "'cp_size' is 0"),
    "cp_size_string": (lambda o: o.__setitem__("cp_size", "2"), "'cp_size' is '2'"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_dump_is_one_line_naming_the_file_and_the_field(
    run_dir, tmp_path, capsys, case
):
    change, field = MALFORMED[case]
    target = run_dir / "3_1.pt"
    if case.endswith("cp_size") or case == "cp_size_string":
        for f in run_dir.glob("3_*.pt"):  # every file agrees: only the data can refute it
            _mutate(f, change)
    else:
        _mutate(target, change)
    line = _one_line(cli_error(capsys, run_dir, "--out", tmp_path / "out"))
    assert "3_" in line and field in line, line
    assert not (tmp_path / "out").exists()  # nothing written


def test_log_probs_shorter_than_the_mask(tmp_path, capsys):
    d = tmp_path / "d"
    write_per_rank(d, 0, make_rollout(0, 0.1), dp=2, cp=1)
    for key in ("log_probs", "rollout_log_probs"):
        _mutate(d / "0_1.pt", lambda o, k=key: o["rollout_data"][k].__setitem__(
            1, o["rollout_data"][k][1][:-1]))  # fmt: skip
    line = _one_line(cli_error(capsys, d, "--out", tmp_path / "out"))
    assert "0_1.pt" in line and "sample 1: 'log_probs'" in line, line


def test_response_longer_than_total_under_cp(run_dir, tmp_path, capsys):
    # the mask still matches the response length: only total_length is wrong
    _mutate(run_dir / "2_0.pt", lambda o: o["rollout_data"]["total_lengths"].__setitem__(0, 5))
    line = _one_line(cli_error(capsys, run_dir, "--out", tmp_path / "out"))
    assert "2_0.pt" in line and "'response_lengths' is 9" in line and "'total_lengths' 5" in line


def test_out_naming_an_existing_file(run_dir, tmp_path, capsys):
    out = tmp_path / "results.csv"
    out.write_text("keep")
    line = _one_line(cli_error(capsys, run_dir, "--out", out))
    assert str(out) in line and "--out" in line
    assert out.read_text() == "keep"


def test_a_huge_cp_size_is_refused_before_any_allocation(run_dir, tmp_path):
    import resource
    import time

    for f in run_dir.glob("*.pt"):
        _mutate(f, lambda o: o.__setitem__("cp_size", 10**12))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(DumpError, match="'cp_size' is 1000000000000"):
        analyze([run_dir], tmp_path / "out")
    assert time.monotonic() - start < 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB
