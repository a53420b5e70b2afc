"""drift.gpt2 (Fig 3): GPT-2 with linear attention (LinearGPT2) or GLA with a forget factor
(GatedLinearGPT2), ICL fine-tuned on SST-2 and MNLI; accuracy and confidence against the number of
demonstrations k.

Pipeline (Sec 5.3): load a pretrained GPT-2 and its tokenizer from ``--model-path`` and the GLUE
data from ``--data-path`` (nothing is downloaded); for each λ in ``lambdas`` swap every attention
layer (:func:`iclab.models.gpt2_gla.swap_attention`, GPT-2's own q/k/v/output weights kept; λ = 1 is
LinearGPT2), fine-tune with AdamW (lr 5e-5, weight decay 0.05, β1 0.9, 1000 iterations) on prompts of
k_train demonstrations (20 for SST-2, 10 for MNLI) with the loss on label tokens, then evaluate on
the validation split at k ∈ {1, 5, 10, 15, 20} (SST-2) / {1, 3, 5, 7, 10} (MNLI): accuracy, and
confidence = mean over CORRECT predictions of the largest label probability (softmax over the label
tokens' logits).

Expected layout of ``--data-path DIR`` (GLUE, as exported by ``datasets`` or as the GLUE tsv files):

    DIR/sst2/train.jsonl       {"sentence": ..., "label": 0|1}          (or train.tsv: sentence<TAB>label)
    DIR/sst2/validation.jsonl  (or dev.tsv)
    DIR/mnli/train.jsonl       {"premise", "hypothesis", "label": 0 entailment|1 neutral|2 contradiction}
                               (or train.tsv with sentence1, sentence2, gold_label columns)
    DIR/mnli/validation_matched.jsonl  (or dev_matched.tsv; _mismatched with mnli_split=mismatched)

``--model-path DIR`` is a folder of ``GPT2LMHeadModel.save_pretrained`` and its tokenizer (e.g.
``huggingface-cli download openai-community/gpt2 --local-dir DIR`` on a machine with internet).
``python -m iclab.experiments.drift._gpt2_fixture DIR`` writes a tiny random-init GPT-2, a
word-level tokenizer and tiny SST-2/MNLI-shaped datasets, to try the pipeline anywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import field_validator

from iclab.experiments._config import ExperimentConfig, param
from iclab.experiments._memory import FLOAT32, total
from iclab.experiments._plot import COLORS, figure
from iclab.experiments import Experiment, register
from iclab.experiments.checks import check_at_least, check_at_most
from iclab.experiments.drift._common import PAPER

Task = Literal["sst2", "mnli"]

#: Prompt template (input part, label words), our choice: the paper does not give its template.
TEMPLATES = {
    "sst2": {"fields": ("sentence",), "prefix": ("Review:", "\nSentiment:"),
             "labels": (" negative", " positive")},
    "mnli": {"fields": ("premise", "hypothesis"), "prefix": ("Premise:", "\nHypothesis:", "\nAnswer:"),
             "labels": (" yes", " maybe", " no")},  # entailment, neutral, contradiction (GLUE's 0, 1, 2)
}
SEPARATOR = "\n\n"
MNLI_TSV_LABELS = {"entailment": 0, "neutral": 1, "contradiction": 2}
DOWNLOAD_MODEL = ("download GPT-2 small on a machine with internet, e.g. `huggingface-cli download "
                  "openai-community/gpt2 --local-dir DIR` (config.json, model.safetensors, tokenizer files), copy DIR "
                  "here and pass --model-path DIR")
DOWNLOAD_DATA = ("put GLUE {task} there, e.g. on a machine with internet `datasets.load_dataset('glue', '{task}')` "
                 "and `.to_json('{path}/<split>.jsonl')` for the splits train and {val}, or the GLUE tsv files "
                 "(train.tsv, {tsv})")


class Gpt2Config(ExperimentConfig):
    model_path: str | None = param(None, "folder of a pretrained GPT-2 (save_pretrained) with its tokenizer "
                                   "(also --model-path)", paper="GPT-2 small (117M)", paper_note="not on this machine")
    data_path: str | None = param(None, "folder with sst2/ and mnli/ GLUE data (also --data-path); layout in the notes",
                                  paper="SST-2 and MNLI", paper_note="not on this machine")
    tasks: list[Task] = param(["sst2", "mnli"], "tasks run: sst2 (Fig 3a-b), mnli (Fig 3c-d)", paper=["sst2", "mnli"])
    lambdas: list[float | list[float]] = param(
        [1.0, 0.9], "forget factors λ, one model each (1 = LinearGPT2); a list gives one λ per layer",
        paper=[1.0, 0.9], paper_note="λ = 0.9 reported best; the others tried are unspecified")
    granularity: Literal["token", "demonstration"] = param(
        "demonstration", "where the gate λ applies: at every token, or once per demonstration (segment)", paper=None,
        paper_note="unspecified; a token-level λ = 0.9 remembers ~10 tokens, far short of 20 demonstrations")
    normalize: bool = param(True, "divide each attention output by Σ_u D_{t,u} (a decayed average)", paper=None,
                            paper_note="unspecified; eq 5 has no normaliser")
    feature_map: Literal["identity", "elu1"] = param("identity", "feature map of queries and keys", paper="identity",
                                                     paper_note="eq 5 has none")
    k_train_sst2: int = param(20, "demonstrations per fine-tuning prompt, SST-2", paper=20, ge=0, le=200)
    k_train_mnli: int = param(10, "demonstrations per fine-tuning prompt, MNLI", paper=10, ge=0, le=200)
    eval_k_sst2: list[int] = param([1, 5, 10, 15, 20], "demonstration counts evaluated, SST-2", paper=[1, 5, 10, 15, 20])
    eval_k_mnli: list[int] = param([1, 3, 5, 7, 10], "demonstration counts evaluated, MNLI", paper=[1, 3, 5, 7, 10])
    steps: int = param(1000, "AdamW iterations", paper=1000, ge=1, le=1_000_000)
    batch: int = param(4, "prompts per iteration", paper=None, paper_note="unspecified", ge=1, le=4096)
    lr: float = param(5e-5, "AdamW learning rate (constant)", paper=5e-5, paper_note="schedule unspecified",
                      gt=0, le=1)
    weight_decay: float = param(0.05, "AdamW weight decay", paper=0.05, ge=0, le=10)
    b1: float = param(0.9, "AdamW β1 (the paper's momentum)", paper=0.9, ge=0, lt=1)
    b2: float = param(0.999, "AdamW β2", paper=None, paper_note="unspecified; torch's default", ge=0, lt=1)
    loss_on: Literal["all", "query"] = param(
        "all", "label tokens in the loss: every demonstration's and the query's, or the query's only",
        paper=None, paper_note="'loss on label tokens only'; which labels is unspecified")
    label_space: Literal["vocab", "labels"] = param(
        "vocab", "cross-entropy over the full vocabulary or over the label tokens only", paper=None,
        paper_note="unspecified")
    balanced: bool = param(True, "demonstrations drawn with equal counts per class (the remainder at random), shuffled",
                           paper=None, paper_note="unspecified")
    max_example_tokens: int = param(64, "tokens kept of each sentence (premise, hypothesis)", paper=None,
                                    paper_note="unspecified", ge=1, le=1024)
    train_pool: int = param(20_000, "training examples used (a seeded subset; 0: all)", ge=0, le=10_000_000)
    eval_examples: int = param(0, "validation examples evaluated per k (the first ones; 0: all)", ge=0,
                               le=10_000_000)
    eval_batch: int = param(8, "prompts per evaluation forward pass", ge=1, le=4096)
    mnli_split: Literal["matched", "mismatched"] = param("matched", "MNLI validation split", paper=None,
                                                         paper_note="unspecified")
    check_claims: bool = param(True, "check the paper's claim (GLA beats LA on accuracy and confidence); off for smoke "
                               "runs too short to learn anything", paper=True)
    device: str = param("auto", "torch device: auto (CUDA if visible, else CPU), cpu, cuda")

    @field_validator("model_path", "data_path")
    @classmethod
    def _absolute(cls, v):
        return None if v is None else str(Path(v).expanduser().resolve())

    @field_validator("lambdas")
    @classmethod
    def _lams(cls, v):
        flat = [x for lam in v for x in (lam if isinstance(lam, list) else [lam])]
        if not v or any(not (0 < x <= 1) for x in flat):
            raise ValueError("lambdas must be a non-empty list of λ (or per-layer lists of λ) in (0, 1]")
        return v

    @field_validator("eval_k_sst2", "eval_k_mnli")
    @classmethod
    def _ks(cls, v):
        if not v or any(k < 0 for k in v):
            raise ValueError("demonstration counts must be a non-empty list of k ≥ 0")
        return sorted(set(v))

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, v):
        if not v:
            raise ValueError("tasks must name sst2, mnli or both")
        return list(dict.fromkeys(v))

    def k_train(self, task: str) -> int:
        return self.k_train_sst2 if task == "sst2" else self.k_train_mnli

    def eval_ks(self, task: str) -> list[int]:
        return self.eval_k_sst2 if task == "sst2" else self.eval_k_mnli


# ---------------------------------------------------------------------------------------------- data


def split_files(task: str, mnli_split: str = "matched") -> dict:
    """Accepted file names per split, jsonl first."""
    if task == "sst2":
        return {"train": ["train.jsonl", "train.tsv"], "validation": ["validation.jsonl", "dev.tsv"]}
    return {"train": ["train.jsonl", "train.tsv"],
            "validation": [f"validation_{mnli_split}.jsonl", f"dev_{mnli_split}.tsv"]}


def find_split(data_path: str, task: str, split: str, mnli_split: str = "matched") -> Path:
    """The file of one split, or ValueError saying what to download and where to put it."""
    folder = Path(data_path) / task
    names = split_files(task, mnli_split)[split]
    for name in names:
        if (folder / name).is_file():
            return folder / name
    val = "validation" if task == "sst2" else f"validation_{mnli_split}"
    tsv = "dev.tsv" if task == "sst2" else f"dev_{mnli_split}.tsv"
    raise ValueError(f"data_path: no {' or '.join(names)} in {folder}: "
                     + DOWNLOAD_DATA.format(task=task, path=folder, val=val, tsv=tsv))


def read_examples(path: Path, task: str) -> list[tuple[dict, int]]:
    """(fields, label) pairs of a jsonl or GLUE tsv file; unlabelled rows (label −1) are dropped."""
    fields = TEMPLATES[task]["fields"]
    out = []
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    row = json.loads(line)
                    out.append(({f: str(row[f]) for f in fields}, int(row["label"])))
    else:
        with open(path, encoding="utf-8") as fh:
            header = fh.readline().rstrip("\n").split("\t")
            for line in fh:
                cols = dict(zip(header, line.rstrip("\n").split("\t")))
                if task == "sst2":
                    out.append(({"sentence": cols["sentence"]}, int(cols["label"])))
                else:
                    out.append(({"premise": cols["sentence1"], "hypothesis": cols["sentence2"]},
                                MNLI_TSV_LABELS.get(cols.get("gold_label", ""), -1)))
    return [(f, y) for f, y in out if y >= 0]


class Encoder:
    """Token ids of examples in the template: input part (ending where the label is predicted) and label."""

    def __init__(self, tokenizer, task: str, max_example_tokens: int):
        self.tok, self.task, self.max = tokenizer, task, max_example_tokens
        t = TEMPLATES[task]
        self.prefix = [self._ids(p) for p in t["prefix"]]
        self.sep = self._ids(SEPARATOR)
        self.label_ids = [self._ids(w)[0] for w in t["labels"]]
        if len(set(self.label_ids)) != len(self.label_ids):
            raise ValueError(f"the tokenizer maps the label words {t['labels']} to the same first token")

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def encode(self, fields: dict) -> list[int]:
        parts = [self._ids(" " + fields[f])[: self.max] for f in TEMPLATES[self.task]["fields"]]
        ids = list(self.prefix[0])
        for part, pre in zip(parts, self.prefix[1:] + [[]]):
            ids += part + pre
        return ids


def build_prompt(demos: list[tuple[list[int], int]], query: tuple[list[int], int], label_ids, sep, n_positions: int):
    """Token ids, segment ids, label positions and classes of one prompt; the oldest demonstrations are
    dropped until it fits ``n_positions``. Returns (ids, seg, pos, cls, n_dropped)."""
    demos = list(demos)
    dropped = 0
    while True:
        ids, seg, pos, cls = [], [], [], []
        for j, (x, y) in enumerate(demos):
            ids += x
            pos.append(len(ids) - 1)
            cls.append(y)
            ids += [label_ids[y]] + sep
            seg += [j] * (len(x) + 1 + len(sep))
        ids += query[0]
        seg += [len(demos)] * len(query[0])
        pos.append(len(ids) - 1)
        cls.append(query[1])
        if len(ids) <= n_positions or not demos:
            if len(ids) > n_positions:
                raise ValueError(f"a query alone has {len(ids)} tokens > the model's {n_positions} positions: lower "
                                 "max_example_tokens")
            return ids, seg, pos, cls, dropped
        demos.pop(0)
        dropped += 1


def sample_demos(rng, pool_labels: np.ndarray, k: int, n_classes: int, balanced: bool, exclude: int = -1):
    """Indices of k demonstrations from the pool (balanced over classes if asked), shuffled."""
    if k == 0:
        return []
    if not balanced:
        idx = rng.choice(pool_labels.size, size=k + 1, replace=False)
        return [int(i) for i in idx if i != exclude][:k]
    counts = np.full(n_classes, k // n_classes)
    counts[rng.choice(n_classes, size=k % n_classes, replace=False)] += 1
    idx = []
    for c in range(n_classes):
        members = np.flatnonzero(pool_labels == c)
        members = members[members != exclude]
        idx += [int(i) for i in rng.choice(members, size=min(counts[c], members.size), replace=False)]
    rng.shuffle(idx)
    return idx


def collate(prompts, pad_id: int):
    """Right-padded ICLBatch from (ids, seg, pos, cls) tuples; label columns left-padded (query last)."""
    import torch

    from iclab.experiments.drift._icl_torch import ICLBatch

    T = max(len(p[0]) for p in prompts)
    M = max(len(p[2]) for p in prompts)
    B = len(prompts)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    seg = torch.zeros((B, T), dtype=torch.long)
    pos = torch.zeros((B, M), dtype=torch.long)
    cls = torch.full((B, M), -1, dtype=torch.long)
    for b, (i, s, p, c, *_) in enumerate(prompts):
        ids[b, :len(i)] = torch.as_tensor(i)
        seg[b, :len(s)] = torch.as_tensor(s)
        seg[b, len(s):] = s[-1] + 1  # padding: a segment of its own, after the query
        pos[b, M - len(p):] = torch.as_tensor(p)
        cls[b, M - len(c):] = torch.as_tensor(c)
    return ICLBatch(ids, seg, pos, cls)


# ---------------------------------------------------------------------------------------------- checks of input


def preflight(config: Gpt2Config) -> None:
    """Fails fast, before anything is stored, with one line saying what is missing and where to put it."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as err:
        raise ValueError(f"drift.gpt2 needs torch and transformers: pip install -e '.[llm]' ({err})") from None
    if config.model_path is None:
        raise ValueError("model_path: none given; " + DOWNLOAD_MODEL)
    model_dir = Path(config.model_path)
    if not model_dir.is_dir():
        raise ValueError(f"model_path: {model_dir} does not exist; " + DOWNLOAD_MODEL)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"model_path: {model_dir} has no config.json (not a save_pretrained folder); " + DOWNLOAD_MODEL)
    if config.data_path is None:
        raise ValueError("data_path: none given; pass --data-path DIR with DIR/sst2 and DIR/mnli (see "
                         "`iclab show drift.gpt2`)")
    if not Path(config.data_path).is_dir():
        raise ValueError(f"data_path: {config.data_path} does not exist; make it a folder with sst2/ and mnli/ GLUE "
                         "data (see `iclab show drift.gpt2`)")
    for task in config.tasks:
        for split in ("train", "validation"):
            find_split(config.data_path, task, split, config.mnli_split)


#: GPT-2 small's sizes, for a model folder whose config.json cannot be read.
GPT2_SMALL = {"n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257}


def model_sizes(model_path: str | None) -> dict:
    """n_embd, n_layer, n_head, n_positions, vocab_size of the GPT-2 in ``model_path`` (its config.json), else
    GPT-2 small's."""
    sizes = dict(GPT2_SMALL)
    try:
        saved = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (TypeError, OSError, ValueError):
        return sizes
    sizes.update({k: int(saved[k]) for k in sizes if isinstance(saved.get(k), int)})
    return sizes


def memory_gpt2(config: Gpt2Config) -> tuple[float, str]:
    """Upper estimate of :func:`run_gpt2`'s memory, float32 (torch), from the model's config.json
    (:func:`model_sizes`): the pretrained weights, the fine-tuned copy with its gradient and AdamW's two moments
    (5 copies); a fine-tuning step over ``batch`` prompts of T tokens, T = the model's positions or
    (k_train + 1) demonstrations of max_example_tokens per field and the template, whichever is less: per token
    and block about 56·n_embd numbers (layer norms, q, k, v and their head-major copies, the 4× MLP and its
    GELU's intermediates, dropout masks) and each head's three (T,) rows of the parallel GLA form's score
    matrices and the decay mask's (:func:`iclab.models.gpt2_gla.gla_parallel`); and the (T, vocabulary) logits
    with their log-softmax and gradient; an evaluation batch's logits."""
    c, m = config, model_sizes(config.model_path)
    E, V, n_pos = m["n_embd"], m["vocab_size"], m["n_positions"]
    params = V * E + n_pos * E + m["n_layer"] * (12 * E * E + 13 * E)
    T = min(n_pos, max((c.k_train(t) + 1) * (len(TEMPLATES[t]["fields"]) * c.max_example_tokens + 16)
                       for t in c.tasks))
    T_eval = min(n_pos, max((max(c.eval_ks(t)) + 1) * (len(TEMPLATES[t]["fields"]) * c.max_example_tokens + 16)
                            for t in c.tasks))
    return total([
        (FLOAT32 * c.batch * T * (m["n_layer"] * (56 * E + 3 * (m["n_head"] + 1) * T) + 3 * V),
         f"a fine-tuning step's activations and logits over {c.batch} prompts of {T} tokens"),
        (5.0 * FLOAT32 * params, "the model's weights, its fine-tuned copy, gradient and AdamW moments"),
        (FLOAT32 * c.eval_batch * T_eval * (2 * V + 8 * E), "an evaluation batch's logits"),
    ])


# ---------------------------------------------------------------------------------------------- run


def load_model(model_path: str):
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    tok = transformers.AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    model = transformers.GPT2LMHeadModel.from_pretrained(model_path, local_files_only=True)
    if model.config.model_type != "gpt2":
        raise ValueError(f"model_path: {model_path} holds a {model.config.model_type} model, not GPT-2")
    return tok, model


def run_gpt2(config: Gpt2Config, reporter) -> dict:
    import copy

    import torch

    from iclab.experiments.drift import _icl_torch as icl
    from iclab.models import gpt2_gla

    c = config
    preflight(c)
    device = icl.resolve_device(c.device)
    tok, base = load_model(c.model_path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    n_pos = base.config.n_positions
    out: dict = {}
    for task in c.tasks:
        enc = Encoder(tok, task, c.max_example_tokens)
        C = len(enc.label_ids)
        train = read_examples(find_split(c.data_path, task, "train", c.mnli_split), task)
        val = read_examples(find_split(c.data_path, task, "validation", c.mnli_split), task)
        rng = np.random.default_rng([c.seed, 11])
        if c.train_pool and len(train) > c.train_pool:
            train = [train[i] for i in sorted(rng.choice(len(train), c.train_pool, replace=False))]
        if c.eval_examples:
            val = val[: c.eval_examples]
        pool = [(enc.encode(f), y) for f, y in train]
        pool_y = np.asarray([y for _, y in pool])
        queries = [(enc.encode(f), y) for f, y in val]
        ks = c.eval_ks(task)
        # Evaluation prompts: the same demonstrations for every model (paired comparison).
        eval_prompts, dropped = [], np.zeros(len(ks), int)
        for j, k in enumerate(ks):
            erng = np.random.default_rng([c.seed, 23, k])
            ps = []
            for q in queries:
                idx = sample_demos(erng, pool_y, k, C, c.balanced)
                p = build_prompt([pool[i] for i in idx], q, enc.label_ids, enc.sep, n_pos)
                dropped[j] += p[4]
                ps.append(p)
            eval_prompts.append(ps)
        S, V, K, N = c.seeds, len(c.lambdas), len(ks), len(queries)
        acc, conf = np.zeros((S, V, K)), np.zeros((S, V, K))
        correct = np.zeros((S, V, K, N), bool)
        n_rec = len(range(0, c.steps, 10)) + (0 if (c.steps - 1) % 10 == 0 else 1)
        losses = np.zeros((S, V, n_rec))
        label_ids = torch.as_tensor(enc.label_ids, device=device)

        def readout(h):
            return h[..., label_ids]

        for s in range(S):
            for v, lam in enumerate(c.lambdas):
                torch.manual_seed(c.seed * 1_000_003 + s)
                model = gpt2_gla.swap_attention(copy.deepcopy(base), lam=lam, granularity=c.granularity,
                                                normalize=c.normalize, feature_map=c.feature_map).to(device)
                model.train()
                trng = np.random.default_rng([c.seed, s, 31])  # the same prompts for every λ

                def loss_fn(step, model=model, trng=trng):
                    prompts = []
                    for _ in range(c.batch):
                        qi = int(trng.integers(len(pool)))
                        idx = sample_demos(trng, pool_y, c.k_train(task), C, c.balanced, exclude=qi)
                        prompts.append(build_prompt([pool[i] for i in idx], pool[qi], enc.label_ids, enc.sep, n_pos))
                    b = collate(prompts, pad_id)
                    b = icl.ICLBatch(*(x.to(device) for x in (b.inputs, b.segment_ids, b.label_pos, b.label_cls)))
                    return icl.classification_loss(model, b, readout, c.loss_on, c.label_space, enc.label_ids,
                                                   embeds=False)

                label = f"{task}: {icl.variant_name(lam)}, seed {s}: AdamW fine-tuning"
                with reporter.task(label, c.steps) as cb:
                    losses[s, v] = icl.train_adamw(model.parameters(), loss_fn, c.steps, lr=c.lr,
                                                   weight_decay=c.weight_decay, betas=(c.b1, c.b2), callback=cb,
                                                   record_every=10)
                with reporter.task(f"{task}: {icl.variant_name(lam)}: evaluation at k = {ks}", K) as cb:
                    for j in range(K):
                        batches = []
                        for i in range(0, N, c.eval_batch):
                            b = collate(eval_prompts[j][i:i + c.eval_batch], pad_id)
                            batches.append(icl.ICLBatch(*(x.to(device) for x in (b.inputs, b.segment_ids,
                                                                                  b.label_pos, b.label_cls))))
                        logits = icl.query_label_logits(model, batches, readout, embeds=False)
                        m = icl.label_metrics(logits, np.asarray([q[1] for q in queries]))
                        acc[s, v, j], conf[s, v, j], correct[s, v, j] = m["accuracy"], m["confidence"], m["correct"]
                        cb(j + 1, {})
                del model
        out.update({f"{task}_ks": np.asarray(ks), f"{task}_accuracy": acc, f"{task}_confidence": conf,
                    f"{task}_correct": correct, f"{task}_train_loss": losses, f"{task}_dropped_demos": dropped,
                    f"{task}_classes": np.asarray(C)})
    return out


def checks_gpt2(config: Gpt2Config, a: dict) -> list:
    from iclab.experiments.drift._icl_torch import paired_accuracy_z, variant_name

    c = config
    out = []
    for task in c.tasks:
        C = int(a[f"{task}_classes"])
        conf = a[f"{task}_confidence"]
        out.append(check_at_most(f"{task}: confidence ≥ 1/{C}: 1/{C} − min over models and k",
                                 1.0 / C - float(np.nanmin(conf)), 0.0,
                                 "confidence is the mean max label probability over correct predictions (Sec 5.3)"))
        out.append(check_at_most(f"{task}: confidence ≤ 1: max − 1", float(np.nanmax(conf)) - 1.0, 0.0,
                                 "a probability"))
        la = [v for v, lam in enumerate(c.lambdas) if variant_name(lam).startswith("Linear")]
        gla = [v for v in range(len(c.lambdas)) if v not in la]
        if not c.check_claims or not la or not gla:
            continue
        acc = a[f"{task}_accuracy"].mean(axis=(0, 2))
        best = max(gla, key=lambda v: acc[v])
        diff, z = paired_accuracy_z(a[f"{task}_correct"][:, best].ravel(), a[f"{task}_correct"][:, la[0]].ravel())
        out.append(check_at_least(f"{task}: {variant_name(c.lambdas[best])} beats LinearGPT2 on accuracy (paired z "
                                  "over all k and validation prompts)", z, 3.0,
                                  f"paper Sec 5.3: GLA > LA 'by a clear margin'; mean gain {diff:+.4f}"))
        cg, cl = float(np.nanmean(conf[:, best])), float(np.nanmean(conf[:, la[0]]))
        out.append(check_at_least(f"{task}: {variant_name(c.lambdas[best])} confidence − LinearGPT2's (mean over k)",
                                  cg - cl, 0.0, "paper Sec 5.3: GLA > LA on confidence"))
    return out


def plot_gpt2(config: Gpt2Config, a: dict):
    from iclab.experiments.drift._icl_torch import variant_name

    c = config
    fig, axes = figure(ncols=2, nrows=len(c.tasks), width=4.2, height=3.2)
    for r, task in enumerate(c.tasks):
        ax_a, ax_c = axes[r]
        ks = a[f"{task}_ks"]
        for v, lam in enumerate(c.lambdas):
            style = dict(color=COLORS[v], marker="o", ms=3, label=variant_name(lam))
            ax_a.plot(ks, a[f"{task}_accuracy"][:, v].mean(0), **style)
            ax_c.plot(ks, a[f"{task}_confidence"][:, v].mean(0), **style)
        for ax, what in ((ax_a, "accuracy"), (ax_c, "confidence")):
            ax.set_xlabel("demonstrations k")
            ax.set_ylabel(f"{task.upper()} {what}")
        ax_a.legend(fontsize=7)
    fig.suptitle(f"drift Fig 3: GPT-2 ({Path(c.model_path or '?').name}) with linear / gated linear attention, "
                 f"{c.granularity}-level λ, {c.steps} AdamW steps", fontsize=9)
    return fig


register(
    Experiment(
        id="drift.gpt2",
        title="Fig 3: GPT-2 with linear vs gated linear attention, ICL fine-tuned on SST-2 and MNLI",
        paper=PAPER,
        reference="Sec 5.3, Fig 3 (accuracy and confidence against the number of demonstrations)",
        config=Gpt2Config,
        presets={
            "quick": {"steps": 20, "train_pool": 2000, "eval_examples": 64, "check_claims": False},
            "paper": {},
        },
        run=run_gpt2,
        checks=checks_gpt2,
        plot=plot_gpt2,
        preflight=preflight,
        memory=memory_gpt2,
        notes=[
            "Needs the optional extra (pip install -e '.[llm]': torch 2.13.0, transformers), a pretrained GPT-2 "
            "folder (--model-path) and the GLUE data (--data-path, layout in the module docstring); nothing is "
            "downloaded. A missing path is a one-line error saying what to download and where to put it.",
            "Data layout: DATA/sst2/{train,validation}.jsonl ({\"sentence\", \"label\"}) or GLUE's train.tsv/dev.tsv; "
            "DATA/mnli/{train,validation_matched}.jsonl ({\"premise\", \"hypothesis\", \"label\"}: 0 entailment, "
            "1 neutral, 2 contradiction) or GLUE's train.tsv/dev_matched.tsv. The model folder is a "
            "save_pretrained GPT-2 with its tokenizer files.",
            "The paper's settings: AdamW lr 5e-5, weight decay 0.05, β1 0.9, 1000 iterations, 20 (SST-2) / 10 (MNLI) "
            "demonstrations at fine-tuning, evaluation at k ∈ {1, 5, 10, 15, 20} / {1, 3, 5, 7, 10}; confidence over "
            "correct predictions only. Our choices (all config fields): the templates and label words (TEMPLATES), "
            "batch 4, β2 0.999, balanced demonstrations, the loss on every label token over the full vocabulary, a "
            "normalised decayed average with identity features, demonstration-level λ, MNLI matched.",
            "Prompts longer than GPT-2's 1024 positions drop their oldest demonstrations (counted in "
            "`<task>_dropped_demos`). Right padding; the linear attention needs no attention mask (causal).",
            "quick is a smoke run of the pipeline (20 steps, 64 validation prompts) and skips the paper's claim "
            "check; `python -m iclab.experiments.drift._gpt2_fixture DIR` writes a tiny random GPT-2 and tiny "
            "datasets to try it on any machine.",
        ],
    )
)
