"""The paper's experiments and the reviewers' ablations, at CPU scale, as plain lit-ess configs.

Every run starts from the same warm-started tiny model (experiments/run.py makes it once) on 2-digit
addition, where the warm start samples the right sum about half the time, so RL has room. A run is
`base_config()` with a cell's overrides (dotted keys into the YAML); the runner writes the result as
an ordinary config file, so any cell can be rerun by hand with `lit-ess fit --config`.

    clip         off-policy regime (4 optimizer steps per rollout): GRPO eps 0.2/0.4/0.6, DAPO, P3O
    temperature  sampling T 0.6/1.2/1.5, trainer at 1.0: GRPO vs P3O, processed vs raw pi_b, P3O's KL anchor
    precision    bf16 rollouts against the fp32 trainer: GRPO vs P3O (fp32 rollouts as control)
    staleness    async, max_staleness 0/1/2/4: P3O, GRPO, decoupled PPO
    ablations    off-policy regime: P3O, without the (1 - e_B) KL term, without the cap, ESS per micro-batch
    stress_k     steps per rollout k up to where methods break: 7 methods x 2 learning rates
    stress_s     staleness S up to where methods break (sync, generated ahead: exactly reproducible)
    multiturn    retry-with-feedback episodes (configs/demo_multiturn.yaml): P3O, GRPO, GRPO + token TIS at S 0/4/8
    remedies_*   issue 39's remedies where P3O breaks (stress_s, multiturn, stress_k k = 48, T = 1.5, in-flight),
                 against P3O and GRPO
    inflight     async on vLLM's server, S = 2: weights pushed in flight against drained, P3O and GRPO (eps 0.2)

Held-out evaluation samples at T = 1.0 in every run (`validation.sampling`), one ruler for every cell; the
temperature cells also get a final evaluation at their own temperature (`Cell.own_val`).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

OBJ = "lit_ess.objectives."


@dataclass
class Cell:
    label: str                        # folder name and legend entry
    overrides: dict = field(default_factory=dict)
    method: str | None = None         # stress experiments: the method (a line per learning rate) ...
    level: int | None = None          # ... and its x (k or S)
    same_as: str | None = None        # "<experiment>/<cell>": the same config, run (and stored) once there


@dataclass
class Experiment:
    name: str
    title: str
    question: str
    cells: list[Cell]
    common: dict = field(default_factory=dict)   # overrides shared by every cell
    axis: str | None = None           # stress experiments: the level's name (x axis of the plot)
    batch_per_step: bool = False      # prompts_per_rollout = scale.prompts x k: the same rows per step at every k
    size: dict = field(default_factory=dict)     # Scale fields capped for this experiment (its runs cost more per step)
    traces: tuple = ()                # (tag, label) pairs: a trace experiment plots these per step and tests no
                                      # difference (its cells are run and tested in other experiments)

    def sized(self, scale: "Scale") -> "Scale":
        """The scale this experiment runs at: `scale` with each field in `size` at most that value (so
        --quick stays quick)."""
        return replace(scale, **{k: min(getattr(scale, k), v) for k, v in self.size.items()})


def objective(name: str, **init_args) -> dict:
    return {"model.init_args.objective": {"class_path": OBJ + name, "init_args": init_args}}


TEMPERATURE = "data.init_args.sampling.temperature"
CALLBACKS = [{"class_path": "lit_ess.callbacks.WeightSync"}]
OFF_POLICY = {"data.init_args.batch.steps_per_rollout": 4}       # 4 optimizer steps per rollout: lag 0..3
K, S = "data.init_args.batch.steps_per_rollout", "data.init_args.schedule.max_staleness"

# The stress experiments' methods: label -> overrides. The corrections and decoupled PPO take pi_prox
# recomputed by the trainer once per phase (PolicyModule.score_phase), as verl and TRL do: the
# correction weighs pi_prox / pi_b, GRPO's clip then acts around pi_prox (at one step per rollout pi_prox
# is the step's own lp.detach(), so this costs no forward there).
METHODS = {
    "grpo_eps0.2": objective("GRPO", clip_eps=0.2),
    "grpo_eps0.6": objective("GRPO", clip_eps=0.6),
    "grpo_tis": objective("GRPO", clip_eps=0.2, correction={"level": "token", "mode": "truncate", "high": 2.0}),
    "grpo_icepop": objective("GRPO", clip_eps=0.2, correction={"level": "token", "mode": "mask", "high": 2.0}),
    "decoupled": objective("DecoupledPPO"),
    "p3o": objective("P3O"),
    "p3o_no_kl": objective("P3O", adaptive_kl=False),
}
LR = 2.0e-4                 # every experiment's learning rate
HIGH_LR = 5.0e-4            # the stress experiments' second one (1e-3 collapsed on-policy in the pilot)
# Levels: k = 48 trains the whole 48-step run on the warm start's samples; in sync mode the lag grows
# by one step every two, so a 48-step run reaches lag 24 at most and any S >= 24 is the same run.
# 7 methods x 2 rates x 3 seeds x (2 + 3) levels = 210 runs (S = 0 is k = 1).
K_LEVELS = (1, 48)          # steps per rollout; the per-step batch stays the same (prompts x k per rollout)
S_LEVELS = (4, 8, 24)      # staleness with k = 1; S = 0 is stress_k's k = 1 run


# The multi-turn task of configs/demo_multiturn.yaml: the policy answers a sum, a wrong answer is told so
# and the question asked again, up to 3 answers, reward 1 / tries (tests/test_experiments.py checks the
# two stay the same). Its warm start is the demo's (configs/demo_sft.yaml), which is the experiments'
# `_base/sft`. Held-out evaluation stays single-turn (first try, exact match): the one ruler of the page.
MULTITURN_ENV = {"env": {"class_path": "lit_ess.envs.RetryArithmetic", "init_args": {"max_tries": 3, "feedback": "wrong"}},
                 "max_turns": 3, "max_episode_tokens": 96}
MULTITURN_METHODS = ("p3o", "grpo_eps0.2", "grpo_tis")
MULTITURN_S = (0, 4, 8)

# issue 39's remedies (no new hyper-parameter), and what each is tested against
REMEDIES = {"p3o_k3_sampled": objective("P3O", kl_estimator="k3_sampled"),
            # the same with the KL's importance weight capped at e_B as the PG weight is (rho >> 1 stays linear)
            "p3o_k3_sampled_capped": objective("P3O", kl_estimator="k3_sampled_capped")}
REMEDIES_K = {"p4o": objective("P4O"), **REMEDIES}
REMEDY_REFERENCES = {m: METHODS[m] for m in ("p3o", "grpo_eps0.2")}
REMEDY_EXPERIMENTS = ("remedies_s", "remedies_multiturn", "remedies_k", "remedies_temperature", "remedies_inflight")

# vLLM's own server (launched by each run), async at S = 2: the two ways a push reaches the server
INFLIGHT_S = 2


def server_engine(weight_update: str) -> dict:
    """The base config's engine (fp32) as a vLLM server that the run launches, taking pushes `weight_update`."""
    return {"data.init_args.engine.class_path": "lit_ess.engines.VLLMServerConfig",
            "data.init_args.engine.init_args.max_model_len": 256,
            "data.init_args.engine.init_args.weight_update": weight_update}


def lr_tag(lr: float) -> str:
    return f"lr{lr:.0e}".replace("e-0", "e-")


def stress(axis: str) -> list[Cell]:
    """Every level x learning rate x method (the first cell is the lowest level of the first line).
    stress_s's S = 0 is stress_k's k = 1 run: the same config, run once."""
    cells = []
    for level in (K_LEVELS if axis == "k" else S_LEVELS):
        for lr in (LR, HIGH_LR):
            for m, over in METHODS.items():
                over = {**over, "model.init_args.optim.lr": lr}
                if axis == "k":
                    cells.append(Cell(f"{m}_{lr_tag(lr)}_k{level}", {**over, K: level}, m, level))
                else:
                    cells.append(Cell(f"{m}_{lr_tag(lr)}_S{level}", {**over, S: level}, m, level))
    if axis == "s":
        cells += [Cell(c.label, c.overrides, c.method, 0, same_as=f"stress_k/{c.label}")
                  for c in stress("k") if c.level == 1]
    return cells


# The mechanism experiments' per-step traces (lit_ess/gradient_profile.py and the objectives' metrics)
TRACES = (("train/policy_lag", "lag of the step's rows"), ("train/kl_behavior", "KL(pi ‖ pi_b), k3 per token"),
          ("train/grad_norm", "gradient norm"), ("train/grad_scale", "‖dL/dlp‖ / a plain policy gradient's"),
          ("train/kl_grad_share", "P3O: KL term's share of ‖dL/dlp‖"),
          ("train/kl_grad_cos", "P3O: cos(policy-gradient term, KL term)"),
          ("train/grad_share_rho_lo", "share of ‖dL/dlp‖ on rho < 1/2"),
          ("train/grad_share_rho_hi", "share of ‖dL/dlp‖ on rho > 2"),
          ("train/capped_frac", "P3O: tokens capped (rho > e_B)"), ("train/sample_nll", "-log p of the samples"))

EXPERIMENTS = {e.name: e for e in [
    Experiment(
        "clip", "Clip sensitivity, off-policy (4 steps per rollout)",
        "Does GRPO's result depend on its clip range when data is stale, and where does P3O land without one?",
        [Cell("grpo_eps0.2", objective("GRPO", clip_eps=0.2)), Cell("grpo_eps0.4", objective("GRPO", clip_eps=0.4)),
         Cell("grpo_eps0.6", objective("GRPO", clip_eps=0.6)),
         Cell("dapo", objective("DAPO", clip_low=0.2, clip_high=0.28)), Cell("p3o", objective("P3O"))],
        common=OFF_POLICY),
    Experiment(
        "temperature", "Sampling temperature against a trainer at 1.0",
        "Rollouts sampled at T = 0.6, 1.2, 1.5 and trained at T = 1.0: how much does each method lose, and "
        "does it matter whether pi_b is the sampler's true distribution (processed) or the untempered "
        "logprobs (raw, the authors' code)?",
        [Cell(f"{m}_T{t}_{lp}", {**objective(cls), "data.init_args.sampling.temperature": t,
                                 "data.init_args.engine.init_args.behavior_logprobs": lp})
         for t in (0.6, 1.2, 1.5) for m, cls in (("grpo", "GRPO"), ("p3o", "P3O")) for lp in ("processed", "raw")]
        # the mechanism test for P3O's collapse at T = 1.5 (processed): is it the KL pull toward pi_b, a
        # tempered copy of the policy? The same cell without the (1 - e_B) KL term.
        + [Cell("p3o_T1.5_processed_no_kl", {**objective("P3O", adaptive_kl=False), TEMPERATURE: 1.5,
                                             "data.init_args.engine.init_args.behavior_logprobs": "processed"})]
        # the remedy: the KL anchored at the behaviour weights scored at the trainer's temperature (pi_prox,
        # recomputed by the trainer), the ratio still against the sampler's true pi_b. At one step per
        # rollout that anchor is the step's own detached policy (the KL term's gradient is 0: the same run
        # as without the KL term), so the remedy is tested at 4 steps per rollout, where the trust region
        # acts, against the paper's anchor (pi_b itself) at the same k.
        + [Cell(f"p3o_T{t}_processed_k4{tag}", {**objective("P3O", **kw), TEMPERATURE: t, K: 4,
                                                "data.init_args.engine.init_args.behavior_logprobs": "processed"})
           for t in (0.6, 1.2, 1.5)
           for tag, kw in (("", {}), ("_anchor", {"kl_anchor": "behavior_at_train_temperature"}))],
        common={"model.init_args.train_temperature": 1.0}),
    Experiment(
        "precision", "bf16 rollouts against an fp32 trainer",
        "Does a lower-precision engine (bf16) hurt, and does the ESS see the mismatch?",
        [Cell(f"{m}_{d}", {**objective(cls), "data.init_args.engine.init_args.dtype": d})
         for m, cls in (("grpo", "GRPO"), ("p3o", "P3O")) for d in ("bfloat16", "float32")]),
    Experiment(
        "staleness", "Asynchronous rollouts, staleness bound S",
        "With the engine generating ahead in its own process (lag up to S optimizer steps), how do P3O, GRPO "
        "and decoupled PPO cope as S grows?",
        [Cell(f"{m}_S{s}", {**objective(cls), "data.init_args.schedule.mode": "async", "data.init_args.schedule.max_staleness": s})
         for m, cls in (("p3o", "P3O"), ("grpo", "GRPO"), ("decoupled", "DecoupledPPO")) for s in (0, 1, 2, 4)]),
    Experiment(
        "ablations", "P3O ablations, off-policy (4 steps per rollout)",
        "Which parts of P3O matter: the (1 - e_B) KL term, the cap at e_B, the ESS over the whole step?",
        [Cell("p3o", objective("P3O")), Cell("p3o_no_kl", objective("P3O", adaptive_kl=False)),
         Cell("p3o_no_cap", objective("P3O", ess_cap=False)),
         Cell("p3o_ess_micro", {**objective("P3O"), "model.init_args.ess_scope": "micro",
                                "model.init_args.micro_batch.size": 16})],
        common=OFF_POLICY),
    Experiment(
        "stress_k", "Stress: steps per rollout k",
        "With k optimizer steps per rollout (lag 0..k-1; every step trains on the same number of rows, the "
        "rollout grows with k), at which k does each method break, at the experiments' learning rate and at "
        "a higher one?",
        stress("k"), axis="steps per rollout k", batch_per_step=True),
    Experiment(
        "stress_s", "Stress: staleness S (generated ahead, deterministic)",
        "One step per rollout, the engine generating ahead with older weights as far as the bound S allows "
        "(`mode: sync` with `max_staleness` S: the lag is exactly reproducible, no worker process and no "
        "timing noise; it grows from 0 by about one step every two steps until it reaches S, the mean lag is "
        "on the page): at which S does each method break?",
        stress("s"), axis="staleness S"),
    Experiment(
        "multiturn", "Multi-turn: retry with feedback, staleness S",
        "Episodes of up to 3 answers (a wrong one is told `wrong` and asked again, reward 1 / tries; the "
        "environment's tokens are context, never trained on), one step per rollout, the engine generating "
        "ahead by up to S steps as in stress_s (sync, exactly reproducible): do P3O, GRPO (eps 0.2) and GRPO "
        "with token-level truncated IS keep learning as S grows, and do the episodes get shorter (the task "
        "pays fewer tries more)?",
        [Cell(f"{m}_S{s}", {**METHODS[m], S: s}, m, s) for s in MULTITURN_S for m in MULTITURN_METHODS],
        common={"data.init_args.env": MULTITURN_ENV}, axis="staleness S",
        # an episode is up to 3 engine calls and a longer row to train: 8 prompts x 8 samples, 32 steps
        # keep the 27 runs within about an hour on the 2 shared cores
        size={"steps": 32, "prompts": 8, "val_every": 8}),
    # Where P3O breaks (issue 39): the cells where it falls below GRPO (eps 0.2) at the page's 8 seeds, run
    # again with the same configs to log where each objective's gradient goes (lit_ess/gradient_profile.py):
    # the KL term's share of dL/dlp and its cosine with the policy gradient's, the step's size against a
    # plain policy gradient, the gradient on tokens with rho < 1/2 and > 2, the capped fraction, and the
    # policy's -log p of its samples. What goes wrong first?
    Experiment(
        "mechanism_stress", "Where P3O breaks: staleness S, per-step traces",
        "stress_s's cells at the high learning rate where P3O falls below GRPO (eps 0.2), S = 8 and 24, "
        "traced step by step: what goes wrong first?",
        [Cell(f"{m}_S{s}", {**METHODS[m], "model.init_args.optim.lr": HIGH_LR, S: s}, m, s)
         for s in (8, 24) for m in ("p3o", "grpo_eps0.2")], traces=TRACES),
    Experiment(
        "mechanism_multiturn", "Where P3O breaks: multi-turn, per-step traces",
        "The multi-turn cells where P3O falls below GRPO (eps 0.2), S = 4 and 8, traced step by step.",
        [Cell(f"{m}_S{s}", {**METHODS[m], S: s}, m, s) for s in (4, 8) for m in ("p3o", "grpo_eps0.2")],
        common={"data.init_args.env": MULTITURN_ENV}, traces=TRACES,
        size={"steps": 32, "prompts": 8, "val_every": 8}),
    # Remedies without a new knob (issue 39), in the cells where P3O breaks, against P3O and GRPO (eps 0.2)
    # as stored there (`same_as`): P3O with its KL estimated on the sampler's tokens (k3 weighted by rho,
    # whose pull on tokens the policy has left vanishes instead of growing as 1/rho: the mechanism traces),
    # and the authors' P4O where a rollout trains several steps (at one step per rollout it is P3O).
    Experiment(
        "remedies_s", "Remedies where P3O breaks: staleness S",
        "stress_s's cells at the high learning rate (S = 4, 8, 24): does P3O with its KL term estimated on "
        "the sampler's tokens (`kl_estimator: k3_sampled`, and `k3_sampled_capped` with its weight capped at e_B) hold where "
        "P3O falls below GRPO (eps 0.2)?",
        [Cell(f"{m}_{lr_tag(HIGH_LR)}_S{s}", {**over, "model.init_args.optim.lr": HIGH_LR, S: s}, m, s,
              same_as=None if m in REMEDIES else f"stress_s/{m}_{lr_tag(HIGH_LR)}_S{s}")
         for s in S_LEVELS for m, over in {**REMEDIES, **REMEDY_REFERENCES}.items()]),
    Experiment(
        "remedies_multiturn", "Remedies where P3O breaks: multi-turn",
        "The multi-turn cells where P3O falls below GRPO (eps 0.2), S = 4 and 8: the same remedy.",
        [Cell(f"{m}_S{s}", {**over, S: s}, m, s, same_as=None if m in REMEDIES else f"multiturn/{m}_S{s}")
         for s in (4, 8) for m, over in {**REMEDIES, **REMEDY_REFERENCES}.items()],
        common={"data.init_args.env": MULTITURN_ENV}, size={"steps": 32, "prompts": 8, "val_every": 8}),
    Experiment(
        "remedies_k", "Remedies where a rollout trains many steps: P4O and the remedy at k = 48",
        "stress_k's k = 48 cells (the whole run trains on the warm start's samples): the authors' P4O (a second "
        "ESS against the phase's proximal policy, the KL toward the mixture of both anchors) and P3O with the "
        "KL estimated on the sampler's tokens, against P3O and GRPO (eps 0.2).",
        [Cell(f"{m}_{lr_tag(lr)}_k48", {**over, "model.init_args.optim.lr": lr, K: 48}, m, 48,
              same_as=None if m in REMEDIES_K else f"stress_k/{m}_{lr_tag(lr)}_k48")
         for lr in (LR, HIGH_LR) for m, over in {**REMEDIES_K, **REMEDY_REFERENCES}.items()],
        batch_per_step=True),
    Experiment(
        "remedies_temperature", "Remedies where P3O breaks: sampling temperature T = 1.5",
        "Rollouts sampled at T = 1.5 (processed pi_b), the trainer at 1.0, where P3O falls below GRPO at one "
        "step per rollout and collapses at 4: the capped remedy (KL toward pi_b estimated on the sampler's "
        "tokens, its weight capped at e_B), and P4O at 4 steps per rollout, against P3O with either KL anchor and "
        "GRPO (eps 0.2).",
        [Cell(f"{m}_T1.5_processed{tag}", {**over, TEMPERATURE: 1.5, **kw,
                                           "data.init_args.engine.init_args.behavior_logprobs": "processed"},
              m, same_as=ref)
         for tag, kw in (("", {}), ("_k4", {K: 4}))
         for m, over, ref in (("p3o_k3_sampled_capped", REMEDIES["p3o_k3_sampled_capped"], None),
                              ("p3o", METHODS["p3o"], f"temperature/p3o_T1.5_processed{tag}"),
                              # the temperature experiment's GRPO (clip_eps 0.2, its default) ran at k = 1 only
                              ("grpo_eps0.2", objective("GRPO") if not tag else METHODS["grpo_eps0.2"],
                               "temperature/grpo_T1.5_processed" if not tag else None))]
        # P4O where a rollout trains several steps (at k = 1 it is P3O)
        + [Cell("p4o_T1.5_processed_k4", {**REMEDIES_K["p4o"], TEMPERATURE: 1.5, K: 4,
                                          "data.init_args.engine.init_args.behavior_logprobs": "processed"}, "p4o")]
        + [Cell("p3o_T1.5_processed_k4_anchor",
                {**objective("P3O", kl_anchor="behavior_at_train_temperature"), TEMPERATURE: 1.5, K: 4,
                 "data.init_args.engine.init_args.behavior_logprobs": "processed"},
                "p3o_anchor", same_as="temperature/p3o_T1.5_processed_k4_anchor")],
        common={"model.init_args.train_temperature": 1.0}),
    Experiment(
        "remedies_inflight", "Remedies where P3O breaks: in-flight weight updates, S = 2",
        "inflight's in-flight cells (async on a vLLM server launched by each run, pushes applied to running "
        "requests): the capped remedy against P3O and GRPO (eps 0.2).",
        [Cell(f"{m}_in_flight", {**over, **server_engine("in_flight")}, m,
              same_as=None if m in REMEDIES else f"inflight/{m}_in_flight")
         for m, over in (("p3o_k3_sampled_capped", REMEDIES["p3o_k3_sampled_capped"]),
                         ("p3o", METHODS["p3o"]), ("grpo_eps0.2", METHODS["grpo_eps0.2"]))],
        common={"data.init_args.schedule.mode": "async", S: INFLIGHT_S}),
    Experiment(
        "inflight", "In-flight weight updates on vLLM's server, staleness S = 2",
        "Async rollouts on a vLLM server that each run launches, the trainer pushing after every step: pushes "
        "that freeze the running requests and let them go on with the new weights (in flight: a row may hold "
        "tokens of two versions, each with its own pi_b) against pushes that let them finish first (drained). "
        "Does either update hurt P3O or GRPO (eps 0.2) at the same bound S = 2?",
        [Cell(f"{m}_{w}", {**METHODS[m], **server_engine(w)}) for w in ("in_flight", "drain")
         for m in ("p3o", "grpo_eps0.2")],
        common={"data.init_args.schedule.mode": "async", S: INFLIGHT_S}),
]}


@dataclass
class Scale:
    """How big every run is. `full` is the evidence; `quick` only proves the pipeline (CI): every
    experiment, its first `cells` cells, from a warm start too short to be good (a model, not a good one)."""
    seeds: int
    steps: int
    val_every: int
    prompts: int
    samples: int
    sft_steps: int
    val_prompts: int
    cells: int | None = None          # run only the first `cells` cells of each experiment


FULL = Scale(seeds=3, steps=48, val_every=12, prompts=16, samples=8, sft_steps=3000, val_prompts=128)
QUICK = Scale(seeds=1, steps=4, val_every=4, prompts=8, samples=4, sft_steps=50, val_prompts=16, cells=1)


def base_config(model_path: str, out_dir: str, seed: int, scale: Scale) -> dict:
    """The RL config every cell starts from (configs/demo.yaml at experiment scale)."""
    return {
        "seed_everything": seed,
        "model": {"class_path": "lit_ess.module.PolicyModule",
                  "init_args": {"model_path": model_path, "optim": {"lr": LR, "max_grad_norm": 1.0},
                                "objective": {"class_path": OBJ + "P3O"}}},
        "data": {"class_path": "lit_ess.datamodules.RolloutDataModule", "init_args": {
            "source": {"class_path": "lit_ess.datamodules.Arithmetic",
                       "init_args": {"digits": 2, "ops": "+", "size": 10000, "seed": 0, "split": "train"}},
            "engine": {"class_path": "lit_ess.engines.VLLMConfig", "init_args": {"dtype": "float32"}},
            "sampling": {"temperature": 1.0, "max_new_tokens": 8, "seed": seed},
            "reward": "exact_match", "seed": seed,
            "batch": {"prompts_per_rollout": scale.prompts, "samples_per_prompt": scale.samples, "steps_per_epoch": 1},
            "validation": {"source": {"class_path": "lit_ess.datamodules.Arithmetic",
                                      "init_args": {"digits": 2, "ops": "+", "size": scale.val_prompts, "seed": 1,
                                                    "split": "test"}},
                           "prompts": scale.val_prompts, "samples": 4, "sampling": {"temperature": 1.0}}}},
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": scale.steps,
                    "check_val_every_n_epoch": scale.val_every, "log_every_n_steps": 1,
                    "enable_progress_bar": False, "enable_checkpointing": False,
                    "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                               "init_args": {"save_dir": out_dir, "name": "tb", "version": ""}},
                    "callbacks": list(CALLBACKS)},
    }


def temperature(cell: Cell) -> float:
    """The cell's sampling temperature. Held-out evaluation is at T = 1.0 for every cell; a cell at
    another temperature is also evaluated at its own after training (against the warm start at it)."""
    return float(cell.overrides.get(TEMPERATURE, 1.0))


def base_folder(temp: float) -> str:
    """The warm start's held-out evaluation at `temp`, under the runs' or the summaries' `_base/`."""
    return "val" if temp == 1.0 else f"val_T{temp}"


def cell_lr(cell: Cell) -> float:
    return float(cell.overrides.get("model.init_args.optim.lr", LR))


def apply(cfg: dict, overrides: dict) -> dict:
    """Set dotted keys (`data.init_args.sampling.temperature`) in a nested config, in place. Values are
    copied: a run's config never shares a list with a cell (or with another run) that it could grow."""
    for key, value in overrides.items():
        parts = key.split(".")
        node = cfg
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = copy.deepcopy(value)
    return cfg
