"""From masks to training on SmolLM2-135M: GRPO with every weight, inside the Fisher mask, inside a random
mask of the same density, and inside the top |policy gradient| set, on one budget and one seed.

1. Prompts: single-digit additions after three worked examples ("2+5= 7\\n6+3= 9\\n4+4= 8\\na+b="), a
   training split and a held-out split (fixed by the seed); reward 1 when the response starts with the
   answer (``^\\s*{target}(\\D|$)``, as benchmarks/bench_study.py).
2. A study on the training split (fisherscope's exact sequence Fisher of K responses per prompt, top-k 20
   sampler): the Fisher mask at density q (written as a mask file), and the top q by |policy gradient|
   of the same responses; a random mask of exactly ceil(q P) coordinates (seeded).
3. Per arm, TRL's GRPOTrainer with the same seed, steps, prompts per step, generations (top-k 20, as the
   study samples), learning rate and AdamW; the masked arms through ``mask_optimizer``. Recorded: the
   held-out reward (greedy) every few steps, the training reward, KL(pi || pi_start) per token on
   responses the trained policy samples for the held-out prompts, the wall time, and ``fisherscope
   updates`` of the trained checkpoint against the start with the Fisher mask file: the shares that
   changed, and whether the full run's largest updates lie where the Fisher points (beside chance).

Prints the table, writes ``summary.json`` and ``reward_curves.html`` (plotly) into ``--out``.
Usage: .venv/bin/python benchmarks/bench_masks.py [--steps 30] [--q 0.01] [--out bench_masks_out]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend.mask_files import MaskFile  # noqa: E402
from backend.registry import model_dir  # noqa: E402
from backend.rewards import RewardKind, RewardRule  # noqa: E402
from backend.settings import get_settings  # noqa: E402
from backend.tokens import TokenCodec  # noqa: E402
from backend.vocabulary import Sampler  # noqa: E402
from workers.fisher.study import StudyStat  # noqa: E402
from workers.masked_training import mask_optimizer  # noqa: E402
from workers.models.loading import load_model  # noqa: E402
from workers.studies.files import write_masks  # noqa: E402
from workers.studies.masks import level_map, mask_tensors  # noqa: E402
from workers.studies.prompts import StudyPrompt, encode_prompts  # noqa: E402
from workers.studies.runner import model_meta, run_study_part, study_model_of  # noqa: E402
from workers.studies.spec import CompareAt, StudySpec  # noqa: E402
from workers.studies.summary import finish_study  # noqa: E402
from workers.weight_updates import compare_checkpoints  # noqa: E402

MODEL = "smollm2-135m"
SHOTS = "2+5= 7\n6+3= 9\n4+4= 8\n"
ANSWER_FIRST = r"^\s*{target}(\D|$)"
TOP_K = 20
ARMS = ("full", "fisher", "random", "policy_gradient")


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def arithmetic(
    n_train: int, n_heldout: int, seed: int
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Distinct a+b (single digits), shuffled by the seed: the first ``n_train`` train, the next held out."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(pairs)
    rows = [(f"{SHOTS}{a}+{b}=", f" {a + b}") for a, b in pairs]
    return rows[:n_train], rows[n_train : n_train + n_heldout]


def correct(response: str, target: str) -> float:
    return float(bool(re.match(ANSWER_FIRST.replace("{target}", re.escape(target.strip())), response)))


def grpo_reward(completions, target, **_) -> list[float]:
    return [correct(c, t) for c, t in zip(completions, target, strict=True)]


def run_study(args, train, out: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict, float]:
    """The masks of each masked arm (name -> {param: bool}) and the study's summary; the mask file."""
    loaded = load_model(MODEL)
    codec = TokenCodec(loaded.tokenizer)
    prompts = encode_prompts(
        Path("bench_masks"),
        [StudyPrompt(i, i + 1, text, target) for i, (text, target) in enumerate(train)],
        codec.encode_prefix,
        codec.encode_continuation,
        get_settings().max_prefix_tokens,
    )
    spec = StudySpec(
        Sampler(top_k=TOP_K),
        samples=args.samples,
        max_tokens=args.study_tokens,
        seed=args.seed,
        reward=RewardRule(RewardKind.regex, ANSWER_FIRST),
        fractions=(args.q,),
        compare_at=CompareAt.none,
    )
    started = time.perf_counter()
    part = run_study_part(
        study_model_of(loaded, spec), spec, prompts, memory_budget_bytes=get_settings().engine_memory_bytes
    )
    finished = finish_study(part, spec, model_meta(loaded))
    seconds = time.perf_counter() - started
    write_masks(out / "fisher_masks.safetensors", finished, part, spec)
    gradient = level_map(part.sums, StudyStat.policy_gradient, (args.q,), magnitude=True)
    masks = {
        "fisher": mask_tensors(finished.fisher_levels, args.q, part.sums),
        "policy_gradient": mask_tensors(gradient, args.q, part.sums),
        "random": random_mask(part.sums.shapes, part.sums.names, args.q, args.seed),
    }
    summary = finished.summary
    del loaded, part, finished
    gc.collect()
    return (
        {arm: {n: m.bool() for n, m in tensors.items()} for arm, tensors in masks.items()},
        summary,
        seconds,
    )


def random_mask(shapes: dict, names: list[str], q: float, seed: int) -> dict[str, torch.Tensor]:
    """Exactly ceil(q P) coordinates, uniformly at random (seeded), over the parameters in order."""
    sizes = [math.prod(shapes[n]) for n in names]
    total = sum(sizes)
    inside = torch.zeros(total, dtype=torch.bool)
    inside[torch.randperm(total, generator=torch.Generator().manual_seed(seed))[: math.ceil(q * total)]] = (
        True
    )
    out, offset = {}, 0
    for name, size in zip(names, sizes, strict=True):
        out[name] = inside[offset : offset + size].reshape(shapes[name]).clone()
        offset += size
    return out


@torch.no_grad()
def heldout_reward(model, tokenizer, heldout) -> float:
    """Greedy responses to the held-out prompts: the share that starts with the answer."""
    was_training = model.training
    model.eval()
    encoded = tokenizer([p for p, _ in heldout], return_tensors="pt", padding=True)
    out = model.generate(**encoded, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(out[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
    model.train(was_training)
    return sum(correct(text, t) for text, (_, t) in zip(texts, heldout, strict=True)) / len(heldout)


@torch.no_grad()
def kl_to_start(model, start, tokenizer, heldout, samples: int, tokens: int, seed: int) -> float:
    """Mean over response tokens of KL(pi || pi_start) over the whole vocabulary, on responses the trained
    policy samples (T 1, top-k 20, as in training) for the held-out prompts."""
    model.eval()
    torch.manual_seed(seed)
    prompts = [p for p, _ in heldout for _ in range(samples)]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    width = encoded["input_ids"].shape[1]
    out = model.generate(
        **encoded, max_new_tokens=tokens, do_sample=True, top_k=TOP_K, pad_token_id=tokenizer.pad_token_id
    )
    attention = torch.cat([encoded["attention_mask"], (out[:, width:] != tokenizer.pad_token_id).long()], 1)
    logp = torch.log_softmax(model(input_ids=out, attention_mask=attention).logits.double(), -1)
    logq = torch.log_softmax(start(input_ids=out, attention_mask=attention).logits.double(), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)[:, width - 1 : -1]  # the distributions of response tokens
    kept = attention[:, width:].bool()
    return float(kl[kept].mean())


def train_arm(arm: str, trainable, args, train, heldout, out: Path, start_reward: float) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    folder = model_dir(MODEL)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    curve = [(0, start_reward)]

    class HeldOut(TrainerCallback):
        def on_step_end(self, arguments, state, control, model=None, **kwargs):
            if state.global_step % args.eval_every == 0 or state.global_step == args.steps:
                curve.append((state.global_step, heldout_reward(model, tokenizer, heldout)))

    config = GRPOConfig(
        output_dir=str(out / "trl" / arm),
        max_steps=args.steps,
        per_device_train_batch_size=args.prompts_per_step * args.generations,
        num_generations=args.generations,
        max_completion_length=args.completion_tokens,
        temperature=1.0,
        top_k=TOP_K,
        learning_rate=args.lr,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        seed=args.seed,
        data_seed=args.seed,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=config.weight_decay)
    if trainable is not None:
        optimizer = mask_optimizer(optimizer, model, trainable)
    data = Dataset.from_dict({"prompt": [p for p, _ in train], "target": [t for _, t in train]})
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=grpo_reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        optimizers=(optimizer, None),
        callbacks=[HeldOut()],
    )
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    train_rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    start = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    kl = kl_to_start(model, start, tokenizer, heldout, args.kl_samples, args.completion_tokens, args.seed)
    saved = out / arm
    model.save_pretrained(saved, safe_serialization=True)
    del model, start, trainer, optimizer
    gc.collect()
    updates = compare_checkpoints(MODEL, str(saved), (args.q,), out / "fisher_masks.safetensors")
    sets = {row["set"]: row for row in updates["masks"]["sets"]}
    top = sets[f"top {args.q:g} |delta|"]
    return {
        "arm": arm,
        "heldout_reward": curve,
        "train_reward_first": sum(train_rewards[:5]) / max(len(train_rewards[:5]), 1),
        "train_reward_last": sum(train_rewards[-5:]) / max(len(train_rewards[-5:]), 1),
        "kl_to_start": kl,
        "wall_s": wall,
        "trainable": None if trainable is None else sum(int(m.sum()) for m in trainable.values()),
        "changed_share": updates["total"]["changed_share"],
        "changed_bf16_share": updates["total"]["changed_bf16_share"],
        "changed_in_fisher_mask": sets["changed"]["overlap"][0],
        "top_delta_in_fisher_mask": top["overlap"][0],
        "top_delta_chance": top["chance_overlap"][0],
        "top_delta_jaccard": top["jaccard"][0],
        "top_delta_chance_jaccard": top["chance_jaccard"][0],
    }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def write_curves(results: list[dict], path: Path) -> None:
    import plotly.graph_objects as go

    figure = go.Figure()
    for row in results:
        steps, rewards = zip(*row["heldout_reward"], strict=True)
        figure.add_trace(go.Scatter(x=steps, y=rewards, mode="lines+markers", name=row["arm"]))
    figure.update_layout(
        title="GRPO on SmolLM2-135M: held-out reward (greedy) by arm (this model's values)",
        xaxis_title="step",
        yaxis_title="held-out reward",
    )
    figure.write_html(str(path))


def print_table(results: list[dict], q: float, study_seconds: float) -> None:
    print(f"\nstudy on the training split: {study_seconds:.0f} s; masks at q = {q:g}")
    print(
        f"{'arm':>16} {'held-out':>15} {'train':>13} {'KL':>9} {'wall s':>7} {'changed':>8} {'in bf16':>8} "
        f"{'top-q|d| in F':>14} {'chance':>7}"
    )
    for row in results:
        first, last = row["heldout_reward"][0][1], row["heldout_reward"][-1][1]
        print(
            f"{row['arm']:>16} {first:>6.3f} -> {last:<6.3f} {row['train_reward_first']:>5.2f} -> "
            f"{row['train_reward_last']:<5.2f} {row['kl_to_start']:>9.2e} {row['wall_s']:>7.0f} "
            f"{row['changed_share']:>8.2%} {row['changed_bf16_share']:>8.2%} "
            f"{row['top_delta_in_fisher_mask']:>14.2%} {row['top_delta_chance']:>7.2%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--q", type=float, default=0.01, help="mask density")
    parser.add_argument("--train", type=int, default=16, help="training prompts")
    parser.add_argument("--heldout", type=int, default=32, help="held-out prompts")
    parser.add_argument("--samples", type=int, default=2, help="the study's responses per prompt")
    parser.add_argument("--study-tokens", type=int, default=4, help="the study's response length")
    parser.add_argument("--completion-tokens", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8, help="GRPO's group size")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--kl-samples", type=int, default=4, help="responses per held-out prompt for KL")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--out", type=Path, default=Path("bench_masks_out"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    train, heldout = arithmetic(args.train, args.heldout, args.seed)
    _log(f"study: {len(train)} prompts x {args.samples} responses x <= {args.study_tokens} tokens, top-k 20")
    masks, study, study_seconds = run_study(args, train, args.out)
    _log(f"study done in {study_seconds:.0f} s")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir(MODEL))
    tokenizer.padding_side = "left"
    start = AutoModelForCausalLM.from_pretrained(model_dir(MODEL), dtype=torch.float32)
    start_reward = heldout_reward(start, tokenizer, heldout)
    del start
    results = []
    for arm in args.arms.split(","):
        _log(f"arm {arm}: {args.steps} GRPO steps")
        results.append(train_arm(arm, masks.get(arm), args, train, heldout, args.out, start_reward))
        _log(f"arm {arm} done in {results[-1]['wall_s']:.0f} s")
    summary = {
        "model": MODEL,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "study_seconds": study_seconds,
        "study_mean_reward": _mean([r["reward"] for r in study["responses"] if r.get("reward") is not None]),
        "masks": {
            "fisher": MaskFile.open(args.out / "fisher_masks.safetensors").metadata,
            "policy_gradient": f"the top {args.q:g} of the study's |policy gradient| (same responses)",
            "random": f"ceil(q P) coordinates drawn uniformly, seed {args.seed}",
        },
        "arms": results,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    write_curves(results, args.out / "reward_curves.html")
    print_table(results, args.q, study_seconds)
    print(f"\nwrote {args.out / 'summary.json'} and {args.out / 'reward_curves.html'}")


if __name__ == "__main__":
    main()
