"""experiment=cell: the methods of a cell measured in one process, interleaved record by record with
the order rotated every record; each method in its own run folder; resume per method."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from conftest import FIXTURES, cli_in_process, compose
from specter.experiments.cell import method_config, rotation
from specter.records.output import comparable

METHODS = ["target_only", "offload_ar", "mo_sc"]
FAST = ["model=tiny_qwen", "memory=high", "hardware=cpu", "dataset=humaneval", "num_prompts=2", "repeats=2",
        "max_new_tokens=3", "warmup_tokens=2", "progress=false", "allow_hub=false",
        f"assets_dir={FIXTURES / 'datasets'}"]


def cell_args(root) -> list[str]:
    return ["experiment=cell", "cell.methods=[" + ",".join(METHODS) + "]", *FAST, f"output_dir='{root}/{{method}}'"]


def all_records(root) -> pd.DataFrame:
    return pd.concat([pd.read_csv(root / m / "records.csv") for m in METHODS], ignore_index=True)


def test_rotation_gives_every_method_every_slot():
    assert [rotation(3, n) for n in range(4)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]


def test_cell_alternates_methods_record_by_record(tmp_path, capsys, tiny_checkpoint):
    tiny_checkpoint("tiny_qwen")
    root = tmp_path / "cell"
    rc, out, err = cli_in_process(cell_args(root), capsys)
    assert rc == 0, err[-2000:]
    records = all_records(root).sort_values("started_at").reset_index(drop=True)
    assert len(records) == len(METHODS) * 2 * 2
    # the timeline, in order of start: round n is record n once per method, in the rotated order
    keys = [("humaneval", i, r) for i in range(2) for r in range(2)]
    expected = [(k, METHODS[j], slot) for n, k in enumerate(keys) for slot, j in enumerate(rotation(len(METHODS), n))]
    seen = [((d, int(i), int(r)), m, int(s)) for d, i, r, m, s in
            records[["dataset", "prompt_index", "repeat", "method", "slot"]].itertuples(index=False)]
    assert seen == expected
    # no record overlaps the next: one after another, each started after the previous one finished
    assert (records.started_at.iloc[1:].to_numpy() >= records.finished_at.iloc[:-1].to_numpy()).all()
    assert (records.finished_at >= records.started_at).all()
    # each method's folder is an ordinary run folder: its own config, summary and provenance
    for m in METHODS:
        folder = root / m
        assert {"config.yaml", "summary.csv", "env.json", "provenance.json"} <= {p.name for p in folder.iterdir()}
        code = json.loads((folder / "provenance.json").read_text())["code"]
        assert code and set(code[0]["trees"]) == {"specter", "baselines"}
    assert "cell tiny_qwen at memory=high" in out


def test_interrupted_cell_measures_only_the_missing_records(tmp_path, capsys, tiny_checkpoint):
    tiny_checkpoint("tiny_qwen")
    root = tmp_path / "cell"
    assert cli_in_process(cell_args(root), capsys)[0] == 0
    first = all_records(root)
    # interrupted: offload_ar lost its last two records, mo_sc its last one
    for m, keep in (("offload_ar", 2), ("mo_sc", 3)):
        lines = (root / m / "records.csv").read_text().splitlines()
        (root / m / "records.csv").write_text("\n".join(lines[:1 + keep]) + "\n")
    untouched = (root / "target_only" / "records.csv").read_bytes()
    rc, out, err = cli_in_process(cell_args(root), capsys)
    assert rc == 0, err[-2000:]
    assert (root / "target_only" / "records.csv").read_bytes() == untouched  # nothing to measure there
    again = all_records(root)
    assert len(again) == len(first)
    key = ["method", "dataset", "prompt_index", "repeat"]
    merged = first.merge(again, on=key, suffixes=("_was", "_now"))
    remeasured = merged[merged.started_at_was != merged.started_at_now]
    assert sorted(map(tuple, remeasured[["method", "prompt_index", "repeat"]].values.tolist())) == \
        [("mo_sc", 1, 1), ("offload_ar", 1, 0), ("offload_ar", 1, 1)]
    assert (remeasured.slot_was == remeasured.slot_now).all()  # the same place in the same round
    assert (merged.output_digest_was == merged.output_digest_now).all()  # per-record seeds: same tokens
    assert remeasured.started_at_now.min() > first.finished_at.max()


@pytest.mark.parametrize("method", ["target_only", "specter"])
def test_a_cells_method_folder_is_the_one_experiment_main_writes(method, tmp_path):
    cell = compose(["experiment=cell", "model=tiny_dsv2", "memory=low", "hardware=emulated",
                    "+cell.hardware.target_only=cpu", f"output_dir='{tmp_path}/{{method}}'"])
    alone = compose(["experiment=main", "model=tiny_dsv2", "memory=low", f"method={method}",
                     f"hardware={'cpu' if method == 'target_only' else 'emulated'}", f"output_dir={tmp_path}/{method}"])
    sub = method_config(cell, method)
    assert comparable(sub) == comparable(alone)
    assert sub.output_dir == f"{tmp_path}/{method}"


def test_bad_cell_lists_are_refused(tmp_path, capsys):
    rc, _, err = cli_in_process(["experiment=cell", "cell.methods=[offload_ar,offload_ar]", *FAST,
                                 f"output_dir={tmp_path}/x"], capsys)
    assert rc == 2 and "more than once" in err
    rc, _, err = cli_in_process(["experiment=cell", "cell.methods=[]", *FAST, f"output_dir={tmp_path}/x"], capsys)
    assert rc == 2 and "cell.methods is empty" in err


def test_a_method_with_a_k_profile_of_its_own_reads_it_and_the_others_read_specters():
    cfg = compose(["experiment=cell", "cell.methods=[specter,moe_spec,specmoeoff,offload_ar]", *FAST,
                   "k_profile=/profiles/specter.json", "+cell.k_profiles.specmoeoff=/profiles/specmoeoff.json"])
    assert method_config(cfg, "specter").k_profile == method_config(cfg, "moe_spec").k_profile == "/profiles/specter.json"
    assert method_config(cfg, "specmoeoff").k_profile == "/profiles/specmoeoff.json"
    assert method_config(cfg, "offload_ar").k_profile is None
