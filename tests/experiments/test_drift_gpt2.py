"""drift.gpt2 and drift.gpt2-offline: prompt building, data loading, metrics, the one-line errors for
missing paths, and both pipelines end to end on tiny models (the tiny local GPT-2 fixture)."""

import json

import numpy as np
import pytest
import torch

from iclab.cli import main
from iclab.experiments.drift import _icl_torch as icl
from iclab.experiments.drift import gpt2, gpt2_offline
from iclab.experiments.drift._gpt2_fixture import write_tiny_fixture
from iclab.launch import run_experiment


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_fixture(tmp_path_factory.mktemp("tiny"))


def test_label_metrics_confidence_counts_correct_predictions_only():
    logits = np.log(np.array([[0.9, 0.1], [0.3, 0.7], [0.6, 0.4], [0.2, 0.8]]))
    m = icl.label_metrics(logits, np.array([0, 1, 1, 0]))
    assert m["accuracy"] == 0.5
    assert m["confidence"] == pytest.approx((0.9 + 0.7) / 2, rel=1e-12)  # the wrong 0.6 and 0.8 are left out
    assert np.isnan(icl.label_metrics(logits[:1], np.array([1]))["confidence"])


def test_build_prompt_positions_segments_and_truncation():
    demos = [([10, 11], 0), ([12], 1), ([13, 14, 15], 0)]
    ids, seg, pos, cls, dropped = gpt2.build_prompt(demos, ([20, 21], 1), label_ids=[90, 91], sep=[5], n_positions=100)
    assert ids == [10, 11, 90, 5, 12, 91, 5, 13, 14, 15, 90, 5, 20, 21]
    assert seg == [0] * 4 + [1] * 3 + [2] * 5 + [3] * 2
    assert [ids[p + 1] for p in pos[:-1]] == [90, 91, 90]  # each label position predicts its label token
    assert pos[-1] == len(ids) - 1 and cls == [0, 1, 0, 1] and dropped == 0
    ids2, _, pos2, cls2, dropped2 = gpt2.build_prompt(demos, ([20, 21], 1), [90, 91], [5], n_positions=9)
    assert dropped2 == 2 and ids2 == [13, 14, 15, 90, 5, 20, 21] and cls2 == [0, 1]  # the oldest went first
    with pytest.raises(ValueError, match="max_example_tokens"):
        gpt2.build_prompt(demos, (list(range(12)), 0), [90, 91], [5], n_positions=9)


def test_balanced_demonstrations_and_exclusion():
    rng = np.random.default_rng(0)
    labels = np.array([0, 1, 2] * 10)
    for k in (3, 7, 10):
        idx = gpt2.sample_demos(rng, labels, k, 3, balanced=True, exclude=4)
        counts = np.bincount(labels[idx], minlength=3)
        assert len(idx) == k and counts.max() - counts.min() <= 1 and 4 not in idx and len(set(idx)) == k


def test_collate_pads_right_and_keeps_the_query_label_last():
    a = gpt2.build_prompt([([1, 2], 0)], ([3], 1), [8, 9], [], 50)
    b = gpt2.build_prompt([], ([4, 5, 6], 0), [8, 9], [], 50)
    batch = gpt2.collate([a, b], pad_id=0)
    assert batch.inputs.tolist() == [[1, 2, 8, 3], [4, 5, 6, 0]]
    assert batch.label_pos.tolist() == [[1, 3], [0, 2]] and batch.label_cls.tolist() == [[0, 1], [-1, 0]]
    assert batch.segment_ids.tolist() == [[0, 0, 0, 1], [0, 0, 0, 1]]


def test_glue_tsv_and_jsonl_readers(tmp_path):
    (tmp_path / "sst2").mkdir()
    (tmp_path / "sst2" / "train.tsv").write_text("sentence\tlabel\na fine film \t1\ndull \t0\n")
    (tmp_path / "mnli").mkdir()
    (tmp_path / "mnli" / "dev_matched.tsv").write_text(
        "index\tsentence1\tsentence2\tgold_label\n0\tA man.\tA person.\tentailment\n1\tX.\tY.\tcontradiction\n"
        "2\tP.\tQ.\t-\n")
    (tmp_path / "mnli" / "train.jsonl").write_text(json.dumps({"premise": "p", "hypothesis": "h", "label": 1}) + "\n"
                                                   + json.dumps({"premise": "p", "hypothesis": "h", "label": -1}))
    assert gpt2.read_examples(gpt2.find_split(str(tmp_path), "sst2", "train"), "sst2") == [
        ({"sentence": "a fine film "}, 1), ({"sentence": "dull "}, 0)]
    assert gpt2.read_examples(gpt2.find_split(str(tmp_path), "mnli", "validation"), "mnli") == [
        ({"premise": "A man.", "hypothesis": "A person."}, 0), ({"premise": "X.", "hypothesis": "Y."}, 2)]
    assert gpt2.read_examples(gpt2.find_split(str(tmp_path), "mnli", "train"), "mnli") == [
        ({"premise": "p", "hypothesis": "h"}, 1)]
    with pytest.raises(ValueError, match=r"no validation.jsonl or dev.tsv in .*sst2: put GLUE sst2 there"):
        gpt2.find_split(str(tmp_path), "sst2", "validation")


def test_missing_paths_are_one_line_errors_and_store_nothing(tmp_path, capsys, tiny):
    model_dir, data_dir = tiny
    root = tmp_path / "results"
    cases = [[], ["--model-path", str(tmp_path / "none"), "--data-path", str(data_dir)],
             ["--model-path", str(model_dir), "--data-path", str(tmp_path)],
             ["--model-path", str(model_dir)]]
    for extra in cases:
        rc = main(["run", "drift.gpt2", "--out", str(root), *extra])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and err.count("\n") == 0 and err.startswith("error: drift.gpt2: ")
        assert ("model_path" in err or "data_path" in err), err
        assert any(what in err for what in ("download", "--data-path", "put GLUE")), err  # says what to do
    assert not root.exists() or not any(p.is_dir() for p in root.iterdir())
    assert main(["run", "drift.fig1", "--model-path", str(model_dir)]) == 2
    assert "--model-path applies only" in capsys.readouterr().err


def test_gpt2_pipeline_end_to_end_on_the_tiny_fixture(tmp_path, tiny):
    model_dir, data_dir = tiny
    overrides = {"model_path": str(model_dir), "data_path": str(data_dir), "steps": 3, "eval_examples": 8,
                 "lambdas": [1.0, [0.5, 0.9]], "eval_k_sst2": [0, 2], "eval_k_mnli": [1, 3], "check_claims": True}
    r = run_experiment("drift.gpt2", "quick", overrides, root=tmp_path)
    arr = np.load(r.path / "trajectories.npz")
    assert arr["sst2_accuracy"].shape == (1, 2, 2) and arr["mnli_correct"].shape == (1, 2, 2, 8)
    assert arr["sst2_train_loss"].shape == (1, 2, 2)  # steps 0 and 2 (the last) and np.all(np.isfinite(arr["mnli_train_loss"]))
    names = [c["name"] for c in r.checks]
    assert any("beats LinearGPT2" in n for n in names)  # the claim check is there when asked for
    assert (r.path / "figure.png").stat().st_size > 0
    again = run_experiment("drift.gpt2", "quick", overrides, root=tmp_path)
    assert again.reused and again.path == r.path


def test_drifting_prompts_and_the_hand_built_predictor():
    gen = torch.Generator().manual_seed(0)
    tok, yq, (x, y, xq) = gpt2_offline.drifting_prompts(gen, 256, 6, 1, gamma=1.0, label_noise=0.0)
    assert tok.shape == (256, 7, 3) and torch.equal(tok[:, :6, 1], y) and torch.all(tok[:, -1, 2] == 1)
    # d = 1, γ = 1: one fixed w, so sign(Σ y_i x_i x_q) = sign(w x_q) is always right.
    assert gpt2_offline.decayed_correlation_accuracy(x, y, xq, yq, 1.0).mean() == 1.0
    # Labels flipped with probability 1/4 show up as disagreement with the noiseless rule.
    gen = torch.Generator().manual_seed(1)
    _, _, (x, y, _) = gpt2_offline.drifting_prompts(gen, 4000, 1, 1, gamma=1.0, label_noise=0.25)
    gen = torch.Generator().manual_seed(1)
    _, _, (_, y0, _) = gpt2_offline.drifting_prompts(gen, 4000, 1, 1, gamma=1.0, label_noise=0.0)
    assert abs(float((y != y0).float().mean()) - 0.25) < 4 * np.sqrt(0.25 * 0.75 / 4000)


def test_gpt2_offline_runs_end_to_end_tiny(tmp_path):
    overrides = {"steps": 4, "lambdas": [1.0, 0.8], "eval_prompts": 64, "n_layer": 1, "n_embd": 16, "n_demos": 8,
                 "eval_ks": [2, 8]}
    r = run_experiment("drift.gpt2-offline", "quick", overrides, root=tmp_path)
    arr = np.load(r.path / "trajectories.npz")
    assert arr["accuracy"].shape == (1, 2, 2) and arr["correct"].shape == (1, 2, 2, 64)
    assert len(r.checks) == 4
