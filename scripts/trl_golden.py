"""GRPO golden numbers from TRL's own trainer code.

For each fixed case (tests/trl/cases below), this runs TRL's real
`GRPOTrainer._generate_and_score_completions` (rewards to advantages, truncation masks,
the token count `num_items_in_batch`, the old and reference log-probs) on the case's
generation batch, splits it into loss microbatches as TRL's `_prepare_inputs` does
(`split_tensor_dict`; the shuffle is left out so that the order is the case's), and for
every iteration and microbatch runs TRL's real `_compute_loss` with the case's log-probs
as a leaf tensor, `backward()`, and records `dL/dlogp` per response token: the
coefficients HiLoRe computes.

What is replaced, and why: the model (its log-probs are the case's numbers, returned by
a stand-in for `_get_per_token_logps_and_entropies`), generation (`_generate` returns the
case's token ids) and the reward functions (`_calculate_rewards` returns the case's
rewards per function), and the accelerator (one process). Everything between them is
TRL's code.

Usage: python scripts/trl_golden.py OUT_DIR   (one JSON file per case)
"""

import json
import math
import os
import random
import sys
import tempfile
import types
from collections import defaultdict

import torch
import trl
import trl.trainer.grpo_trainer as gt
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import split_tensor_dict

EOS, PAD = 2, 0


class OneProcess:
    """The accelerator of a single CPU process."""

    device = torch.device("cpu")
    process_index = 0
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x.reshape(-1) if x.dim() == 0 else x

    def gather_for_metrics(self, x):
        return self.gather(x)

    def reduce(self, x, reduction="sum"):
        return x

    def unwrap_model(self, m):
        return m


def trainer_for(args, n_funcs):
    """A GRPOTrainer with __init__'s loss-relevant attributes, set as __init__ sets them."""
    t = GRPOTrainer.__new__(GRPOTrainer)
    t.args = args
    t.accelerator = OneProcess()
    t.model = types.SimpleNamespace(training=True, name="policy", is_gradient_checkpointing=False)
    t.ref_model = types.SimpleNamespace(training=False, name="reference") if args.beta != 0.0 else None
    t._tokenizer = types.SimpleNamespace(pad_token_id=PAD)
    t._is_vlm = False
    t.eos_token_ids = [EOS]
    t.reward_func_names = [f"r{i}" for i in range(n_funcs)]
    t.reward_funcs = [None] * n_funcs
    if args.reward_weights is not None:
        t.reward_weights = torch.tensor(args.reward_weights, dtype=torch.float32)
    else:
        t.reward_weights = torch.ones(n_funcs, dtype=torch.float32)
    t.environment_factories = None
    t.environments = None
    t.tools = None
    t._standalone_tools = None
    t.max_completion_length = args.max_completion_length
    t.num_generations = args.num_generations
    t.num_generations_eval = args.num_generations_eval or args.num_generations
    t.temperature = args.temperature
    t.pad_to_multiple_of = args.pad_to_multiple_of
    t.use_vllm = False
    t.vllm_importance_sampling_correction = False
    t.loss_type = args.loss_type
    t.multi_objective_aggregation = args.multi_objective_aggregation
    t.router_aux_loss_coef = 0.0
    t.aux_loss_enabled = False
    t.scale_rewards = args.scale_rewards
    t.importance_sampling_level = args.importance_sampling_level
    t.off_policy_mask_threshold = args.off_policy_mask_threshold
    t.mask_truncated_completions = args.mask_truncated_completions
    t.top_entropy_quantile = args.top_entropy_quantile
    t.entropy_coef = args.entropy_coef
    t.use_adaptive_entropy = args.use_adaptive_entropy
    t._entropy_bonus_enabled = t.entropy_coef != 0.0 or t.use_adaptive_entropy
    t.num_iterations = args.num_iterations
    t.epsilon_low = args.epsilon
    t.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    t.beta = args.beta
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t.log_multimodal = False
    t._logs = {
        "images": [],
        "prompt": [],
        "completion": [],
        "rewards": defaultdict(list),
        "advantages": [],
        "extra": defaultdict(list),
    }
    t._pending_extra_logs = defaultdict(list)
    t._pending_metrics = defaultdict(list)
    return t


def padded(rows, width, fill=0.0):
    out = torch.full((len(rows), width), fill, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def run_case(case):
    cfg = case["config"]
    lengths = case["lengths"]
    n = len(lengths)
    width = max(lengths)
    rewards = case["rewards"]  # per sequence, per reward function
    n_funcs = len(rewards[0])
    with tempfile.TemporaryDirectory() as d:
        args = GRPOConfig(output_dir=d, report_to="none", use_cpu=True, **cfg)
    t = trainer_for(args, n_funcs)
    G = args.num_generations
    B, GA, SPG = args.per_device_train_batch_size, args.gradient_accumulation_steps, args.steps_per_generation
    assert B * SPG == n, (B, SPG, n)

    # The policy's log-probs at each optimizer step since the generation: step 0 is the
    # generation's own policy (TRL's old log-probs, when it computes them, are these).
    state = {}

    def logps(model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kw):
        if model is t.ref_model:
            x = padded(case["ref_logps"], width)
        elif state["phase"] == "generation":
            x = padded(case["old_logps"], width)
        else:
            x = state["current"]
        ent = torch.zeros_like(x) if compute_entropy else None
        return x, ent, None

    t._get_per_token_logps_and_entropies = logps
    completion_ids = []
    for i, l in enumerate(lengths):
        ids = [5 + (i + k) % 7 for k in range(l)]
        if not case["truncated"][i]:
            ids[-1] = EOS
        completion_ids.append(ids)
    prompt_ids = [[7, 8, 9] for _ in range(n)]

    def generate(prompts):
        texts = [f"completion {i}" for i in range(n)]
        return prompt_ids, completion_ids, None, texts, None, {}, None, None

    t._generate = generate
    t._calculate_rewards = lambda inputs, prompts, completions, ids: torch.tensor(rewards, dtype=torch.float32)
    gt.gather_object = lambda x: x
    state["phase"] = "generation"
    inputs = [{"prompt": f"prompt {i // G}"} for i in range(n)]
    out = t._generate_and_score_completions(inputs)
    advantages = out["advantages"].tolist()
    chunks = split_tensor_dict(out, SPG)
    steps = SPG // GA
    updates = []
    for it in range(args.num_iterations):
        for m, chunk in enumerate(chunks):
            step = m // GA
            update = it * steps + step
            rows = list(range(m * B, (m + 1) * B))
            cur = padded([case["logps"][str(update)][i] for i in rows], width).requires_grad_(True)
            state["phase"] = "loss"
            state["current"] = cur
            t.current_gradient_accumulation_steps = GA
            loss = t._compute_loss(t.model, chunk)
            loss.backward()
            grad = cur.grad
            for k, i in enumerate(rows):
                updates.append(
                    {
                        "update": update,
                        "iteration": it,
                        "step": step,
                        "sequence": i,
                        "coefficients": grad[k, : lengths[i]].tolist(),
                    }
                )
    # The batch `hilore coefficients --input` takes at each update: every completion's
    # log-probs under that update's policy, the sampling policy's from update 1 on.
    G_ = G
    batches = []
    for u in sorted(case["logps"], key=int):
        groups = []
        for g in range(n // G_):
            comps = []
            for i in range(g * G_, (g + 1) * G_):
                c = {"logps": case["logps"][u][i]}
                if int(u) > 0:
                    c["old_logps"] = case["old_logps"][i]
                if case.get("ref_logps") is not None:
                    c["ref_logps"] = case["ref_logps"][i]
                if case["truncated"][i]:
                    c["truncated"] = True
                comps.append(c)
            rw = [r[0] if len(r) == 1 else r for r in rewards[g * G_:(g + 1) * G_]]
            groups.append({"rewards": rw, "completions": comps})
        batches.append({"update": int(u), "groups": groups})
    return {
        "name": case["name"],
        "description": case["description"],
        "trl_version": trl.__version__,
        "torch_version": torch.__version__,
        "config": cfg,
        "batches": batches,
        "trl": {
            "advantages": advantages,
            "num_items_in_batch": int(out["num_items_in_batch"]),
            "computed_old_logps": "old_per_token_logps" in out,
            "coefficients": updates,
        },
    }


def make_case(name, description, seed, prompts, G, cfg, n_funcs=1, reward_levels=(0.0, 1.0), all_equal_groups=(0,),
              max_len=9, truncate_some=False):
    """A case: random lengths, rewards and log-probs (fixed seed), and the TRL config."""
    rng = random.Random(seed)
    n = prompts * G
    cfg = dict(cfg)
    cfg.setdefault("num_generations", G)
    cfg.setdefault("max_completion_length", max_len)
    cfg.setdefault("per_device_train_batch_size", n // cfg.get("steps_per_generation", cfg.get("gradient_accumulation_steps", 1)))
    lengths = [rng.randint(1, max_len) for _ in range(n)]
    truncated = [truncate_some and lengths[i] == max_len for i in range(n)]
    rewards = [[rng.choice(reward_levels) for _ in range(n_funcs)] for _ in range(n)]
    for g in all_equal_groups:
        for j in range(G):
            rewards[g * G + j] = [reward_levels[-1]] * n_funcs
    old = [[rng.uniform(-4.0, -0.05) for _ in range(l)] for l in lengths]
    ref = [[x + rng.uniform(-0.8, 0.8) for x in o] for o in old]
    # The policy at each optimizer step since the generation: step 0 equals the
    # generation's, later ones move each log-prob by up to +-0.45 (ratios 0.64-1.57, so
    # both clip sides and delta are hit), kept 1e-3 (relative) away from the clip
    # boundaries so float32 and float64 take the same branch.
    eps = cfg.get("epsilon", 0.2)
    eps_high = cfg.get("epsilon_high", eps)
    bounds = [1 - eps, 1 + eps_high] + ([cfg["delta"]] if cfg.get("delta") else [])
    steps = cfg.get("steps_per_generation", cfg.get("gradient_accumulation_steps", 1)) // cfg.get("gradient_accumulation_steps", 1)
    updates = steps * cfg.get("num_iterations", 1)
    logps = {"0": [list(o) for o in old]}
    for u in range(1, updates):
        seqs = []
        for o in old:
            row = []
            for x in o:
                while True:
                    d = rng.uniform(-0.45, 0.45)
                    if all(abs(math.exp(d) - b) > 1e-3 * b for b in bounds):
                        break
                row.append(x + d)
            seqs.append(row)
        logps[str(u)] = seqs
    # Inputs are float32 on both sides.
    f32 = lambda xs: [float(torch.tensor(x, dtype=torch.float32)) for x in xs]
    return {
        "name": name,
        "description": description,
        "config": cfg,
        "lengths": lengths,
        "truncated": truncated,
        "rewards": [f32(r) for r in rewards],
        "old_logps": [f32(o) for o in old],
        "ref_logps": [f32(r) for r in ref] if cfg.get("beta", 0.0) != 0.0 else None,
        "logps": {u: [f32(s) for s in v] for u, v in logps.items()},
    }


def cases():
    c = []
    add = lambda *a, **k: c.append(make_case(*a, **k))
    # Every loss type, one step and several.
    for k, lt in enumerate(["dapo", "grpo", "dr_grpo", "bnpo"]):
        add(f"{lt}-one-step", f"{lt}, 4 prompts x 4, one microbatch, one iteration", 10 + k, 4, 4,
            {"loss_type": lt})
        add(f"{lt}-accumulation-iterations", f"{lt}, 5 prompts x 4, accumulation 4 (4 microbatches of 5), 2 iterations, beta 0.04",
            20 + k, 5, 4, {"loss_type": lt, "gradient_accumulation_steps": 4, "num_iterations": 2, "beta": 0.04})
    add("cispo-one-step", "cispo (epsilon_high 1.3 caps the weight), 4 prompts x 6", 30, 4, 6,
        {"loss_type": "cispo", "epsilon_high": 1.3})
    add("cispo-iterations-kl", "cispo, 3 iterations, beta 0.04, accumulation 2", 31, 4, 4,
        {"loss_type": "cispo", "epsilon_high": 1.3, "num_iterations": 3, "beta": 0.04, "gradient_accumulation_steps": 2})
    add("sapo-one-step", "sapo, 4 prompts x 8", 32, 4, 8, {"loss_type": "sapo"})
    add("sapo-iterations", "sapo with its temperatures changed, 2 iterations, accumulation 2", 33, 4, 4,
        {"loss_type": "sapo", "num_iterations": 2, "gradient_accumulation_steps": 2, "sapo_temperature_pos": 0.7,
         "sapo_temperature_neg": 1.6})
    # Sequence-level importance sampling (GSPO).
    add("gspo-grpo", "importance_sampling_level=sequence with grpo, 2 iterations, beta 0.04", 40, 4, 4,
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "num_iterations": 2, "beta": 0.04})
    add("gspo-dapo-no-bias-correction", "sequence level with dapo, no KL bias correction, beta 0.1, 2 iterations", 41, 4, 4,
        {"loss_type": "dapo", "importance_sampling_level": "sequence", "num_iterations": 2, "beta": 0.1,
         "use_bias_correction_kl": False})
    # Options.
    add("delta-two-sided", "dapo with delta 1.45, epsilon_high 0.28, 2 iterations", 50, 4, 4,
        {"loss_type": "dapo", "delta": 1.45, "epsilon_high": 0.28, "num_iterations": 2})
    add("scale-rewards-batch", "scale_rewards=batch, grpo, G 6", 51, 5, 6, {"loss_type": "grpo", "scale_rewards": "batch"},
        reward_levels=(0.0, 0.5, 1.0))
    add("scale-rewards-none", "scale_rewards=none (Dr. GRPO), dr_grpo", 52, 4, 4,
        {"loss_type": "dr_grpo", "scale_rewards": "none"})
    add("mask-truncated-grpo", "mask_truncated_completions with grpo and dapo's cousins, accumulation 2", 53, 4, 4,
        {"loss_type": "grpo", "mask_truncated_completions": True, "gradient_accumulation_steps": 2}, truncate_some=True,
        max_len=6)
    add("mask-truncated-bnpo", "mask_truncated_completions with bnpo, accumulation 2", 54, 4, 4,
        {"loss_type": "bnpo", "mask_truncated_completions": True, "gradient_accumulation_steps": 2}, truncate_some=True,
        max_len=6)
    add("reward-weights", "two reward functions weighted 1 and 0.5 (sum then normalize)", 55, 4, 4,
        {"loss_type": "dapo", "reward_weights": [1.0, 0.5]}, n_funcs=2, reward_levels=(0.0, 0.5, 1.0))
    add("steps-per-generation", "steps_per_generation 4 with accumulation 2: two optimizer steps per generation, 2 iterations",
        56, 4, 4, {"loss_type": "dapo", "steps_per_generation": 4, "gradient_accumulation_steps": 2, "num_iterations": 2})
    add("steps-per-generation-bnpo", "bnpo, steps_per_generation 4, accumulation 2, beta 0.04", 57, 4, 4,
        {"loss_type": "bnpo", "steps_per_generation": 4, "gradient_accumulation_steps": 2, "beta": 0.04})
    add("residue-group", "an all-equal group of rewards 0.1 (TRL leaves a float residue; HiLoRe gives exactly 0)", 58, 4, 8,
        {"loss_type": "dapo"}, reward_levels=(0.0, 0.1))
    return c


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    for case in cases():
        res = run_case(case)
        path = os.path.join(out, f"{res['name']}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
        mx = max(abs(x) for u in res["trl"]["coefficients"] for x in u["coefficients"])
        print(f"{res['name']}: {len(res['trl']['coefficients'])} sequence-updates, max |c| {mx:.3e}")


if __name__ == "__main__":
    main()
