import asyncio
import copy
import math

import pytest
import torch

from edurl.llm import losses as L
from edurl.llm.clients import AdamParams, ServiceClient
from edurl.llm.datum import Datum, ModelInput, build_datum, build_supervised_datum
from edurl.llm.evaluation import sequence_logprobs
from edurl.llm.sampling import SamplingParams
from edurl.llm.shared_prefix import _ATTENTION_READ_AT_EACH_CALL

PROMPT = [3, 35, 33, 19, 32, 100, 9, 13, 77]


@pytest.fixture()
def trainer(small_model, char_tokenizer):
    torch.manual_seed(0)
    return ServiceClient(device="cpu").create_training_client((small_model, char_tokenizer))


def rl_datums(trainer, n=4, seed=0):
    sampler = trainer.save_weights_and_get_sampling_client("s")
    res = sampler.sample(ModelInput.from_ints(PROMPT), n, SamplingParams(max_tokens=6, seed=seed)).result()
    return [build_datum(PROMPT, s.tokens, s.logprobs, adv) for s, adv in zip(res.sequences, [1.0, -1.0, 0.5, -0.5])]


def test_training_logprobs_match_the_samplers_on_policy(trainer):
    datums = rl_datums(trainer)
    out = trainer.forward_backward(datums, "importance_sampling").result()
    for d, o in zip(datums, out.loss_fn_outputs):
        m = d.loss_fn_inputs["mask"].bool()
        assert torch.allclose(o["logprobs"][m], d.loss_fn_inputs["logprobs"][m], atol=1e-4)
    assert abs(out.metrics["optim/kl_sample_train_v1"]) < 1e-4
    assert out.metrics["optim/clip_fraction"] == 0.0  # one step per batch: every ratio is exactly 1


def test_forward_backward_sum_loss_and_gradient_match_a_hand_written_one(trainer, small_model):
    datums = rl_datums(trainer)
    out = trainer.forward_backward(datums, "importance_sampling").result()
    # the same loss written out by hand on an unchanged copy of the weights
    model = small_model
    model.zero_grad()
    total = 0.0
    for d in datums:
        toks = torch.tensor([d.model_input.to_ints() + [int(d.loss_fn_inputs["target_tokens"][-1])]])
        lp = sequence_logprobs(model, toks)[0]
        m, q, a = (d.loss_fn_inputs[k] for k in ("mask", "logprobs", "advantages"))
        total = total + (-(torch.exp(lp - q) * a) * m).sum()
    assert out.loss == pytest.approx(float(total.detach()), abs=1e-4)
    total.backward()
    mine = dict(model.named_parameters())
    for name, p in trainer.model.named_parameters():
        assert torch.allclose(p.grad, mine[name].grad, atol=1e-5), name
    model.zero_grad()


def group_datums(trainer, prompts, n=4):
    sampler = trainer.save_weights_and_get_sampling_client("s")
    out = []
    for k, prompt in enumerate(prompts):
        res = sampler.sample(ModelInput.from_ints(prompt), n, SamplingParams(max_tokens=6, seed=k)).result()
        out += [build_datum(prompt, s.tokens, s.logprobs, float(j) - 1.5) for j, s in enumerate(res.sequences)]
    return out


@pytest.mark.parametrize("lora", [False, True])
def test_shared_prompts_give_what_whole_rows_give(small_model, char_tokenizer, lora):
    # three groups with prompts of different lengths, shuffled: prompts run once each, completions read their cache
    service = ServiceClient(device="cpu")
    trainers = [
        service.create_lora_training_client((small_model, char_tokenizer), rank=4)
        if lora
        else service.create_training_client((small_model, char_tokenizer), keep_reference=True)
        for _ in range(2)
    ]
    trainers[1].model.load_state_dict(trainers[0].model.state_dict())
    trainers[1].share_prompts = False
    datums = group_datums(trainers[0], [PROMPT, PROMPT[:4], PROMPT[2:] + PROMPT[:3]])
    datums = [datums[i] for i in torch.randperm(len(datums), generator=torch.Generator().manual_seed(0))]
    outs = [
        t.forward_backward(datums, "ppo", aggregation="seq_mean_token_mean", kl_coef=0.1).result() for t in trainers
    ]
    # the advantages of each group sum to 0 and the ratio is 1, so the loss is a sum of O(1) terms that cancel to
    # rounding noise (about 1e-8): compare it at float32's absolute scale; the gradients below carry the check
    assert outs[0].loss == pytest.approx(outs[1].loss, rel=1e-5, abs=1e-6)
    for key in ("optim/entropy", "optim/kl_ref", "optim/kl_sample_train_v2"):
        assert outs[0].metrics[key] == pytest.approx(outs[1].metrics[key], rel=1e-4, abs=1e-7), key
    for a, b in zip(outs[0].loss_fn_outputs, outs[1].loss_fn_outputs):
        assert torch.allclose(a["logprobs"], b["logprobs"], atol=1e-5)  # the prompt's positions too
    grads = [{n: p.grad for n, p in t.model.named_parameters() if p.requires_grad} for t in trainers]
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-4), name


def test_gradient_checkpointing_turns_prompt_sharing_off(trainer):
    # checkpointed layers drop the KV cache in training mode; sharing would then lose the prompt
    datums = rl_datums(trainer)
    before = trainer.forward_backward(datums, "importance_sampling").result()
    trainer.model.gradient_checkpointing_enable()
    after = trainer.forward_backward(datums, "importance_sampling").result()
    for a, b in zip(before.loss_fn_outputs, after.loss_fn_outputs):
        assert torch.allclose(a["logprobs"], b["logprobs"], atol=1e-5)


def test_shared_prompts_for_sft_datums(trainer):
    tokens = PROMPT + [5, 6, 7]
    d = Datum(
        ModelInput.from_ints(tokens[:-1]),
        {"target_tokens": torch.tensor(tokens[1:]), "weights": torch.tensor([0.0] * 8 + [1.0] * 3)},
    )
    shared = trainer.forward_backward([d, d, d], "cross_entropy").result()
    trainer.share_prompts = False
    whole = trainer.forward_backward([d, d, d], "cross_entropy").result()
    assert shared.loss == pytest.approx(whole.loss, rel=1e-5)


def test_gradients_accumulate_until_optim_step(trainer):
    datums = rl_datums(trainer)
    trainer.forward_backward(datums[:2], "importance_sampling")
    g1 = [p.grad.clone() for p in trainer.model.parameters()]
    trainer.forward_backward(datums[2:], "importance_sampling")
    trainer.model.zero_grad()
    trainer.forward_backward(datums[2:], "importance_sampling")
    g2 = [p.grad.clone() for p in trainer.model.parameters()]
    trainer.model.zero_grad()
    trainer.forward_backward(datums, "importance_sampling")
    assert all(torch.allclose(a + b, p.grad, atol=1e-6) for a, b, p in zip(g1, g2, trainer.model.parameters()))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    info = trainer.optim_step(AdamParams(learning_rate=1e-2)).result()
    assert info["optim/grad_norm"] > 0
    assert all(p.grad is None for p in trainer.model.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))


def test_sampler_is_a_snapshot_and_substeps_move_the_ratio(trainer):
    datums = rl_datums(trainer)
    stale = trainer.save_weights_and_get_sampling_client("old")
    trainer.forward_backward(datums, "ppo")
    trainer.optim_step(AdamParams(learning_rate=5e-2))
    out = trainer.forward_backward(datums, "ppo").result()
    assert out.metrics["optim/kl_sample_train_v2"] > 0  # the ratio has left 1
    fresh = trainer.save_weights_and_get_sampling_client("new")
    x = torch.tensor([PROMPT])
    assert not torch.allclose(stale.model(input_ids=x).logits, fresh.model(input_ids=x).logits)


def test_kl_penalty_to_the_reference(trainer):
    datums = rl_datums(trainer)
    out = trainer.forward_backward(datums, "importance_sampling", log_kl_ref=True).result()
    assert out.metrics["optim/kl_ref"] == pytest.approx(0.0, abs=1e-6)  # no step yet: policy == reference
    trainer.optim_step(AdamParams(learning_rate=5e-2))
    out = trainer.forward_backward(datums, "importance_sampling", kl_coef=0.5).result()
    assert out.metrics["optim/kl_ref"] > 1e-4


def test_lora_client_trains_only_the_adapter(small_model, char_tokenizer):
    trainer = ServiceClient(device="cpu").create_lora_training_client((small_model, char_tokenizer), rank=4)
    assert all("lora_" in n for n, p in trainer.model.named_parameters() if p.requires_grad)
    datums = rl_datums(trainer)
    out = trainer.forward_backward(datums, "ppo", log_kl_ref=True).result()
    assert out.metrics["optim/kl_ref"] == pytest.approx(0.0, abs=1e-6)  # LoRA B starts at 0
    trainer.optim_step(AdamParams(learning_rate=1e-2))
    assert trainer.forward_backward(datums, "ppo", log_kl_ref=True).result().metrics["optim/kl_ref"] > 0


def test_a_lora_snapshot_shares_the_frozen_base_and_copies_the_adapter(small_model, char_tokenizer):
    """A sampler snapshot deep-copied the whole model, a real checkpoint's frozen base included (a copy the size of
    the model at every step). The base is shared now; the adapter is copied, so the snapshot keeps its weights while
    the trainer moves on."""
    trainer = ServiceClient(device="cpu").create_lora_training_client((small_model, char_tokenizer), rank=4)
    with torch.no_grad():  # an adapter that is not the identity, so that the snapshot's must be its own copy
        for n, p in trainer.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    snap = trainer.save_weights_and_get_sampling_client("s")
    mine, theirs = dict(trainer.model.named_parameters()), dict(snap.model.named_parameters())
    assert mine.keys() == theirs.keys()
    for n, p in mine.items():
        shared = theirs[n].data_ptr() == p.data_ptr()
        assert shared == (not p.requires_grad), n  # the base is shared, the adapter copied
        assert not theirs[n].requires_grad and torch.equal(theirs[n], p)
    x = torch.tensor([PROMPT])
    base = {n: p.detach().clone() for n, p in mine.items() if not p.requires_grad}
    with torch.no_grad():
        before = snap.model(input_ids=x).logits.clone()
    trainer.forward_backward(rl_datums(trainer), "ppo")
    trainer.optim_step(AdamParams(learning_rate=5e-2))
    with torch.no_grad():
        assert torch.equal(snap.model(input_ids=x).logits, before)  # the snapshot did not move with the trainer
        assert not torch.allclose(trainer.model(input_ids=x).logits, before)
    assert all(torch.equal(mine[n], b) for n, b in base.items())  # training left the shared base as it was
    # moving or casting a snapshot (ProcessSampler moves its first one to the CPU) must leave the trainer's base
    # where it is: a shared Parameter object would be moved with it
    snap.model.to(torch.float64)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert all(torch.equal(mine[n], b) for n, b in base.items())


def test_save_and_load_state_restore_weights_and_optimizer(trainer, small_model, char_tokenizer, tmp_path):
    trainer.log_dir = tmp_path
    datums = rl_datums(trainer)
    trainer.forward_backward(datums, "importance_sampling")
    trainer.optim_step(AdamParams(learning_rate=1e-2))
    path = trainer.save_state("ckpt", extra={"step": 1})
    other = ServiceClient(device="cpu").create_training_client((small_model, char_tokenizer))
    assert other.load_state(path) == {"step": 1}
    for a, b in zip(trainer.model.parameters(), other.model.parameters()):
        assert torch.equal(a, b)
    for c in (trainer, other):  # the same next step, Adam moments included
        c.forward_backward(datums, "importance_sampling")
        c.optim_step(AdamParams(learning_rate=1e-2))
    for a, b in zip(trainer.model.parameters(), other.model.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(FileNotFoundError, match="save_state"):
        other.load_state(tmp_path / "nope")
    weights_only = ServiceClient(device="cpu").create_training_client((small_model, char_tokenizer))
    weights_only.load_state(path, optimizer=False)  # Tinker's load_state: the weights, not the Adam moments
    assert weights_only.optimizer is None
    both = ServiceClient(device="cpu").create_training_client((small_model, char_tokenizer))
    both.load_state(path)
    assert both.optimizer is not None
    for a, b in zip(weights_only.model.parameters(), both.model.parameters()):
        assert torch.equal(a, b)


def test_a_log_dir_under_a_file_is_named(trainer, small_model, char_tokenizer, tmp_path):
    """save_state into a log_dir that is a file, or lies under one, failed with a bare NotADirectoryError from mkdir;
    now the client refuses such a log_dir when it is made, and save_state says how to save the weights still held."""
    (tmp_path / "notes.txt").write_text("keep me")
    for log_dir in (tmp_path / "notes.txt", tmp_path / "notes.txt" / "run"):
        with pytest.raises(NotADirectoryError, match="pass a folder"):
            ServiceClient(device="cpu", log_dir=log_dir).create_training_client((small_model, char_tokenizer))
        trainer.log_dir = log_dir
        with pytest.raises(NotADirectoryError, match="still in memory: set this client's log_dir"):
            trainer.save_state("ckpt")
    trainer.log_dir = tmp_path / "run"
    assert trainer.save_state("ckpt").is_dir() and (tmp_path / "notes.txt").read_text() == "keep me"


def test_forward_is_forward_backward_without_the_gradient(trainer):
    datums = rl_datums(trainer)
    only = trainer.forward(datums, "ppo", aggregation="token_mean").result()
    assert all(p.grad is None for p in trainer.model.parameters())
    both = trainer.forward_backward(datums, "ppo", aggregation="token_mean").result()
    assert only.loss == both.loss and only.metrics == both.metrics
    for a, b in zip(only.loss_fn_outputs, both.loss_fn_outputs):
        assert torch.equal(a["logprobs"], b["logprobs"])
    with pytest.raises(ValueError, match="does not take"):
        trainer.check_inputs(datums, "ppo", {"clip": 0.2})
    trainer.check_inputs(datums, "ppo", {"clip_low_threshold": 0.8})


def test_a_loss_argument_without_a_default_is_asked_for_before_the_model_runs(trainer):
    """dro's beta has no default: check_inputs (the server's 400) and forward_backward both name it, before any
    gradient is taken; both used to accept the call, and forward_backward then failed with a TypeError."""
    datums = rl_datums(trainer)
    with pytest.raises(ValueError, match=r"'dro' needs \['beta'\].*loss_fn_config=\{'beta': 0.05\}"):
        trainer.check_inputs(datums, "dro")
    with pytest.raises(ValueError, match="needs \\['beta'\\]"):
        trainer.forward_backward(datums, "dro", {})
    assert all(p.grad is None for p in trainer.model.parameters())
    with pytest.raises(ValueError, match="max_tokens"):
        trainer.forward_backward(datums, "ppo", aggregation="seq_mean_token_sum_norm")
    assert all(p.grad is None for p in trainer.model.parameters())
    trainer.check_inputs(datums, "dro", {"beta": 0.1})
    assert trainer.forward_backward(datums, "dro", {"beta": 0.1}).result().loss == pytest.approx(
        trainer.forward(datums, "dro", {"beta": 0.1}).result().loss
    )


def test_cross_entropy_loss(trainer):
    tokens = PROMPT + [5, 6, 7]
    d = Datum(
        ModelInput.from_ints(tokens[:-1]),
        {"target_tokens": torch.tensor(tokens[1:]), "weights": torch.tensor([0.0] * 8 + [1.0] * 3)},
    )
    out = trainer.forward_backward([d], "cross_entropy").result()
    assert out.loss == pytest.approx(-float(out.loss_fn_outputs[0]["logprobs"][-3:].sum()), abs=1e-5)


def test_async_variants_return_the_same_futures(trainer):
    datums = rl_datums(trainer)
    fut = asyncio.run(trainer.forward_backward_async(datums, "importance_sampling"))
    assert fut.result().loss == pytest.approx(trainer.forward_backward(datums, "importance_sampling").result().loss)


def test_clear_errors(trainer):
    datums = rl_datums(trainer)
    with pytest.raises(ValueError, match="unknown loss_fn 'grpo'.*importance_sampling"):
        trainer.forward_backward(datums, "grpo")
    with pytest.raises(ValueError, match="unknown aggregation"):
        trainer.forward_backward(datums, "ppo", aggregation="mean")
    bad = Datum(ModelInput.from_ints([1, 2, 3]), {"target_tokens": torch.tensor([2, 3, 4])})
    bad.loss_fn_inputs["logprobs"] = torch.zeros(2)  # bypasses Datum's own check
    bad.loss_fn_inputs["advantages"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"has shape \(2,\) but model_input has 3 tokens"):
        trainer.forward_backward([bad], "importance_sampling")
    with pytest.raises(ValueError, match="lacks"):
        trainer.forward_backward([Datum(ModelInput.from_ints([1, 2]), {"target_tokens": torch.tensor([2, 3])})], "ppo")
    with pytest.raises(ValueError, match="at least one"):
        trainer.forward_backward([], "ppo")
    with pytest.raises(RuntimeError, match="forward_backward first"):
        trainer.optim_step(AdamParams())
    with pytest.raises(ValueError, match="learning_rate"):
        AdamParams(learning_rate=-1.0)


def test_aggregation_is_passed_through(trainer):
    datums = rl_datums(trainer)
    per = {
        mode: trainer.forward_backward(datums, "importance_sampling", aggregation=mode, max_tokens=6).result().loss
        for mode in L.AGGREGATION_MODES
    }
    n_tok = sum(float(d.loss_fn_inputs["mask"].sum()) for d in datums)
    assert per["token_mean"] == pytest.approx(per["sum"] / n_tok, rel=1e-5)
    assert per["seq_mean_token_sum_norm"] == pytest.approx(per["sum"] / (len(datums) * 6), rel=1e-5)


@pytest.mark.cuda
def test_clients_on_cuda(small_model, char_tokenizer):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    trainer = ServiceClient(device="cuda").create_lora_training_client((small_model, char_tokenizer), rank=4)
    datums = rl_datums(trainer)
    out = trainer.forward_backward(datums, "ppo", log_kl_ref=True).result()
    assert abs(out.metrics["optim/kl_sample_train_v1"]) < 1e-3
    trainer.optim_step(AdamParams(learning_rate=1e-3))


@pytest.mark.cuda
def test_moving_a_lora_snapshot_to_the_cpu_leaves_the_trainer_on_cuda(small_model, char_tokenizer):
    """The snapshot shares the frozen base's storage; a first version shared its Parameter objects, so moving the
    snapshot to the CPU (as ProcessSampler does) moved the trainer's base too (found by review, on the CPU by a dtype
    cast; this is the device form, for `make gpu-check`)."""
    trainer = ServiceClient(device="cuda").create_lora_training_client((small_model, char_tokenizer), rank=4)
    snap = trainer.save_weights_and_get_sampling_client("s")
    snap.model.to("cpu")
    assert {p.device.type for p in trainer.model.parameters()} == {"cuda"}
    trainer.forward_backward(rl_datums(trainer), "ppo").result()
    trainer.optim_step(AdamParams(learning_rate=1e-3))


# ---------------------------------------------------------------- review findings (each failed on the old code)


def test_dr_grpo_gradient_does_not_depend_on_other_datums_prompt_lengths(trainer):
    # 8 fixed datums plus one zero-advantage datum whose prompt is 3 or 60 tokens long: with Dr. GRPO's
    # constant divisor (B * max_tokens) the extra datum changes nothing. Dividing by B * T (the old code)
    # made the gradient norm 0.498 with the short prompt and 0.106 with the long one.
    fixed = group_datums(trainer, [PROMPT, PROMPT[:5]], n=4)
    sampler = trainer.save_weights_and_get_sampling_client("s")

    def grads_with_extra(prompt_len):
        prompt = [(7 * i) % 90 + 5 for i in range(prompt_len)]
        seq = (
            sampler.sample(ModelInput.from_ints(prompt), 1, SamplingParams(max_tokens=6, seed=1)).result().sequences[0]
        )
        extra = build_datum(prompt, seq.tokens, seq.logprobs, 0.0)
        trainer.model.zero_grad()
        trainer.forward_backward(
            fixed + [extra], "importance_sampling", aggregation="seq_mean_token_sum_norm", max_tokens=6
        )
        return torch.cat([p.grad.flatten() for p in trainer.model.parameters()])

    short, long = grads_with_extra(3), grads_with_extra(60)
    assert short.norm() > 0
    torch.testing.assert_close(short, long, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="needs max_tokens"):
        trainer.forward_backward(fixed, "importance_sampling", aggregation="seq_mean_token_sum_norm")


def test_training_scores_at_the_sampling_temperature(trainer):
    # sampled at T = 0.7 and scored at T = 0.7, with no update in between: the ratio is exactly 1 (the old code
    # scored at T = 1: kl_sample_train_v1 was about +0.05 and most ratios fell outside [0.8, 1.2])
    sampler = trainer.save_weights_and_get_sampling_client("s")
    res = sampler.sample(
        ModelInput.from_ints(PROMPT), 8, SamplingParams(max_tokens=8, temperature=0.7, seed=0)
    ).result()
    datums = [build_datum(PROMPT, s.tokens, s.logprobs, 1.0) for s in res.sequences]
    out = trainer.forward_backward(datums, "ppo", temperature=0.7).result()
    assert abs(out.metrics["optim/kl_sample_train_v1"]) < 1e-5
    assert out.metrics["optim/clip_fraction"] == 0.0
    for d, o in zip(datums, out.loss_fn_outputs):
        m = d.loss_fn_inputs["mask"].bool()
        torch.testing.assert_close(o["logprobs"][m], d.loss_fn_inputs["logprobs"][m], atol=1e-4, rtol=0)
    at_one = trainer.forward_backward(datums, "ppo").result()  # scored at T = 1 instead: off-policy by mistake
    assert abs(at_one.metrics["optim/kl_sample_train_v1"]) > 1e-3


def test_rl_datums_without_a_mask_are_refused(trainer):
    # the old code guessed mask = (logprobs != 0), silently dropping every token sampled with probability 1
    d = rl_datums(trainer)[0]
    unmasked = Datum(d.model_input, {k: v for k, v in d.loss_fn_inputs.items() if k != "mask"})
    with pytest.raises(ValueError, match="need a 'mask' field"):
        trainer.forward_backward([unmasked], "importance_sampling", aggregation="token_mean")


def test_dropout_is_off_in_the_rl_forward_pass(qwen_dir):
    # an HF model with attention dropout: in train mode the same weights would score the same tokens differently
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(qwen_dir, attention_dropout=0.5)
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    trainer = ServiceClient(device="cpu").create_training_client((model, tok))
    prompt = tok.encode("What is 12+34?")
    res = (
        trainer.save_weights_and_get_sampling_client("s")
        .sample(ModelInput.from_ints(prompt), 8, SamplingParams(max_tokens=8, seed=0))
        .result()
    )
    datums = [build_datum(prompt, s.tokens, s.logprobs, 1.0) for s in res.sequences]
    out = trainer.forward_backward(datums, "ppo").result()
    assert abs(out.metrics["optim/kl_sample_train_v1"]) < 1e-5 and out.metrics["optim/clip_fraction"] == 0.0


def test_full_fine_tuning_of_a_bf16_model_keeps_fp32_master_weights(small_model, char_tokenizer, tmp_path):
    # in bf16 a weight near 0.03 moves in steps of about 1.2e-4, so an Adam step of 4e-5 rounds to nothing:
    # with the update applied to the bf16 weights directly (the old code) no entry moved after 10 steps
    model = copy.deepcopy(small_model)
    with torch.no_grad():  # weights of a real model's typical size, |w| in [0.025, 0.06)
        gen = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if "embed" not in name and "norm" not in name:
                sign = torch.randint(0, 2, p.shape, generator=gen) * 2 - 1
                p.copy_(sign * (0.025 + 0.035 * torch.rand(p.shape, generator=gen)))
    model = model.to(torch.bfloat16)
    trainer = ServiceClient(device="cpu", log_dir=tmp_path).create_training_client((model, char_tokenizer))
    datums = rl_datums(trainer)
    start = trainer.save_weights_and_get_sampling_client("start")
    for _ in range(10):
        trainer.forward_backward(datums, "importance_sampling")
        trainer.optim_step(AdamParams(learning_rate=4e-5))
    now = trainer.save_weights_and_get_sampling_client("now")
    assert all(p.dtype == torch.bfloat16 for p in now.model.parameters())  # the sampler still runs in bf16
    moved = total = 0
    for (name, a), b in zip(start.model.named_parameters(), now.model.parameters()):
        if "embed" in name or "norm" in name:  # rows of unused tokens get no gradient; norms sit at 1.0
            continue
        moved, total = moved + int((a != b).sum()), total + a.numel()
    assert moved >= total / 2, f"only {moved} of {total} bf16 weight entries moved"
    # a checkpoint keeps the fp32 master weights, so a resumed run takes the very same next step
    path = trainer.save_state("ckpt")
    other = ServiceClient(device="cpu").create_training_client((model, char_tokenizer))  # a fresh copy of the start
    other.load_state(path)
    for c in (trainer, other):
        c.forward_backward(datums, "importance_sampling")
        c.optim_step(AdamParams(learning_rate=4e-5))
    for a, b in zip(trainer._master, other._master):
        assert torch.equal(a, b)


@pytest.mark.parametrize("with_optimizer", [False, True])
def test_a_bf16_model_keeps_training_after_load_state(small_model, char_tokenizer, tmp_path, with_optimizer):
    # load_state once built new fp32 master copies while a kept optimizer still held the old ones: every later
    # optim_step stepped the old copies and wrote the unchanged new ones back, so training stopped without a word
    # (load_state(optimizer=False), Tinker's, or a checkpoint saved before the first step)
    model = copy.deepcopy(small_model).to(torch.bfloat16)
    trainer = ServiceClient(device="cpu", log_dir=tmp_path).create_training_client((model, char_tokenizer))
    datums = rl_datums(trainer)
    if with_optimizer:  # a checkpoint without optimizer state: written before the first step
        path = trainer.save_state("before")
    trainer.forward_backward(datums, "importance_sampling")
    trainer.optim_step(AdamParams(learning_rate=1e-2))
    if not with_optimizer:
        path = trainer.save_state("after")
    trainer.load_state(path, optimizer=with_optimizer)
    saved = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.forward_backward(datums, "importance_sampling")
    trainer.optim_step(AdamParams(learning_rate=1e-2))
    moved = sum(int((v != saved[k]).sum()) for k, v in trainer.model.named_parameters())
    assert moved > 0, "no bf16 weight moved in the step after load_state"
    optimized = {id(q) for group in trainer.optimizer.param_groups for q in group["params"]}
    assert optimized == {id(m) for m in trainer._master}


@pytest.mark.parametrize("how", ["weights only", "saved before the first step"])
def test_load_state_without_optimizer_state_starts_a_fresh_optimizer(small_model, char_tokenizer, tmp_path, how):
    # Tinker's load_state is "weights only, optimizer resets": the next step is the one a fresh client loaded from
    # the same checkpoint takes, not one with Adam's moments and step count from steps taken after the save
    service = ServiceClient(device="cpu", log_dir=tmp_path)
    trainer = service.create_training_client((copy.deepcopy(small_model), char_tokenizer))
    datums = rl_datums(trainer)
    if how == "saved before the first step":
        path = trainer.save_state("ckpt")

    def step(client):
        client.forward_backward(datums, "importance_sampling")
        client.optim_step(AdamParams(learning_rate=1e-2))

    step(trainer)
    if how == "weights only":
        path = trainer.save_state("ckpt")
    step(trainer)
    step(trainer)
    trainer.load_state(path, optimizer=how != "weights only")
    fresh = service.create_training_client((copy.deepcopy(small_model), char_tokenizer))
    fresh.load_state(path, optimizer=False)
    for client in (trainer, fresh):
        step(client)
    for a, b in zip(trainer.model.parameters(), fresh.model.parameters()):
        assert torch.equal(a, b)


def test_grad_clip_norm_zero_means_no_clipping_as_in_tinker(trainer):
    datums = rl_datums(trainer)
    trainer.forward_backward(datums, "importance_sampling")
    norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in trainer.model.parameters()]))
    info = trainer.optim_step(AdamParams(learning_rate=0.0, grad_clip_norm=0.0)).result()
    assert info["optim/grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    with pytest.raises(ValueError, match="grad_clip_norm"):
        AdamParams(grad_clip_norm=-1.0)


def test_a_checkpoint_can_keep_a_stale_sampler(trainer, tmp_path):
    trainer.log_dir = tmp_path
    datums = rl_datums(trainer)
    stale = trainer.save_weights_and_get_sampling_client("step_0")
    trainer.forward_backward(datums, "importance_sampling")
    trainer.optim_step(AdamParams(learning_rate=1e-2))
    path = trainer.save_state("ckpt", extra={"step": 1}, sampler=stale)
    restored = trainer.load_sampler(path)
    for a, b in zip(stale.model.parameters(), restored.model.parameters()):
        assert torch.equal(a, b)
    assert trainer.load_sampler(trainer.save_state("no_sampler")) is None


@pytest.mark.parametrize(
    "loss_fn, config, kl_coef",
    [("ppo", {"clip_high_threshold": 1.1}, 0.0), ("cispo", None, 0.3), ("dro", {"beta": 0.2}, 0.1)],
)
def test_forward_backward_loss_is_rl_objectives_on_the_same_tensors(trainer, loss_fn, config, kl_coef):
    # off-policy: one optimizer step first, so the ratio, the clip and the KL are all away from their on-policy values
    datums = rl_datums(trainer)
    trainer.forward_backward(datums, "importance_sampling").result()
    trainer.optim_step(AdamParams(learning_rate=1e-2)).result()
    out = trainer.forward_backward(
        datums, loss_fn, config, aggregation="token_mean", kl_coef=kl_coef, log_kl_ref=True
    ).result()
    ids, attn, f = trainer._batch(datums)
    with torch.no_grad():
        train_lp, entropy = trainer._train_logprobs(ids, attn, f["target_tokens"], f["mask"], with_entropy=True)
        ref_lp = torch.stack(
            [
                torch.nn.functional.pad(r, (0, ids.shape[1] - len(r)))
                for r in trainer.compute_logprobs(datums, reference=True)
            ]
        )
    loss, metrics = L.rl_objective(
        train_lp,
        f["logprobs"],
        f["advantages"],
        f["mask"],
        loss_fn=loss_fn,
        loss_fn_config=config,
        aggregation="token_mean",
        ref_logprobs=ref_lp,
        kl_coef=kl_coef,
        entropy=entropy,
    )
    assert out.loss == pytest.approx(float(loss), rel=1e-5, abs=1e-7)
    assert out.metrics.keys() == metrics.keys()
    for key, value in metrics.items():
        assert out.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert out.metrics["optim/kl_sample_train_v2"] > 0  # really off-policy


def test_cross_entropy_refuses_a_kl_term(trainer):
    d = build_supervised_datum(PROMPT + [5, 6, 7], [0.0] * len(PROMPT) + [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="cross_entropy"):
        trainer.forward_backward([d], "cross_entropy", kl_coef=0.1)


def test_maskless_tinker_style_datums_still_share_their_prompts(small_model, char_tokenizer, monkeypatch):
    """A datum whose mask covers every position (as edurl.serve builds from a Tinker datum) is split where its
    sampled tokens start, so a group's prompt runs once; the log-probs, loss and gradients do not change."""
    import edurl.llm.shared_prefix as sp

    service = ServiceClient(device="cpu")
    trainers = [service.create_training_client((small_model, char_tokenizer), keep_reference=False) for _ in range(2)]
    trainers[1].model.load_state_dict(trainers[0].model.state_dict())
    trainers[1].share_prompts = False
    datums = group_datums(trainers[0], [PROMPT, PROMPT[:4]])
    for d in datums:
        d.loss_fn_inputs["mask"] = torch.ones(d.model_input.length)
    calls = []
    real = sp.packed_logits
    monkeypatch.setattr(
        sp,
        "packed_logits",
        lambda model, prompt_ids, *a, **k: calls.append(len(prompt_ids)) or real(model, prompt_ids, *a, **k),
    )
    outs = [t.forward_backward(datums, "importance_sampling").result() for t in trainers]
    assert calls == [2], "two distinct prompts, each run once"
    # a sum (not a mean) of about 40 terms of size up to 1.5 that cancel (each group's advantages sum to 0, the
    # ratio is 1): float32 rounding alone moves it by a few 1e-6 (eager against sdpa attention gave 0 and -1.4e-6);
    # the log-probs and gradients below carry the check
    assert outs[0].loss == pytest.approx(outs[1].loss, rel=1e-5, abs=1e-5)
    for a, b in zip(outs[0].loss_fn_outputs, outs[1].loss_fn_outputs):
        assert torch.allclose(a["logprobs"], b["logprobs"], atol=1e-5)
    for (name, p), q in zip(trainers[0].model.named_parameters(), trainers[1].model.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-4), name


def test_a_loss_over_the_prompt_keeps_the_prompts_gradient(small_model, char_tokenizer):
    """A datum whose mask covers its prompt, with a KL term in the loss, puts a gradient on the prompt's positions:
    forward_backward keeps it (the packed pass's ``prompt_grad``), so the gradient is that of whole rows. With
    edurl's datums, whose mask leaves the prompt out, the same holds with the prompt's top-layer backward skipped."""
    service = ServiceClient(device="cpu")
    trainers = [service.create_training_client((small_model, char_tokenizer)) for _ in range(2)]
    trainers[1].share_prompts = False
    datums = group_datums(trainers[0], [PROMPT, PROMPT[:4]])
    trainers[0].forward_backward(datums, "importance_sampling").result()
    trainers[0].optim_step(AdamParams(learning_rate=1e-2)).result()  # away from the reference: the KL has a gradient
    trainers[1].model.load_state_dict(trainers[0].model.state_dict())
    covering = copy.deepcopy(datums)
    for d in covering:
        d.loss_fn_inputs["mask"] = torch.ones(d.model_input.length)
    for batch in (covering, datums):
        for t in trainers:
            t.model.zero_grad(set_to_none=True)
            t.forward_backward(batch, "importance_sampling", kl_coef=0.5, kl_estimator="k1").result()
        for (name, p), q in zip(trainers[0].model.named_parameters(), trainers[1].model.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-4), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_fractional_mask_gets_the_gradient_of_whole_rows(small_model, char_tokenizer, dtype):
    # the shared-prompt split once took the first *largest* mask value as a row's first loss position, while the
    # loss counts every non-zero one: a 0.5 just before the completion was scored inside the prompt, without a graph.
    # The loss sums about 40 terms of size 1 that cancel to -0.08: in float32 the two orders of summation part by
    # 1.4e-6 on one machine (and 1e-7 on another), so float32 gets that room. In float64 the losses agree to 1e-15;
    # the gradients of layer 0 and the embedding part by up to 1.6e-7 (of 7), an unexplained rounding left as a doubt
    service = ServiceClient(device="cpu")
    model = copy.deepcopy(small_model).to(dtype)
    trainers = [service.create_training_client((model, char_tokenizer)) for _ in range(2)]
    trainers[1].share_prompts = False
    datums = group_datums(trainers[0], [PROMPT, PROMPT[:4]])
    for d in datums:
        mask, adv = d.loss_fn_inputs["mask"], d.loss_fn_inputs["advantages"]
        i = int(mask.nonzero()[0]) - 1
        mask[i], adv[i] = 0.5, 1.0  # the same advantage in the whole group, or the group's gradients cancel there
    outs = [t.forward_backward(datums, "importance_sampling").result() for t in trainers]
    tight = dtype == torch.float64
    assert outs[0].loss == pytest.approx(outs[1].loss, rel=1e-12 if tight else 1e-5, abs=1e-12 if tight else 1e-5)
    for (name, p), q in zip(trainers[0].model.named_parameters(), trainers[1].model.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-6 if tight else 1e-4), name


def test_target_tokens_outside_the_vocabulary_are_refused(trainer):
    # shared prompts read a flat index: a target past the vocabulary once read another position's log-prob
    vocab = trainer.model.get_output_embeddings().weight.shape[0]
    for bad_token in (vocab, -100):
        datums = rl_datums(trainer)
        datums[1].loss_fn_inputs["target_tokens"][2] = bad_token
        with pytest.raises(ValueError, match=rf"datums\[1\].*target token {bad_token}.*vocabulary of {vocab}"):
            trainer.forward_backward(datums, "importance_sampling")
        with pytest.raises(ValueError, match=rf"target token {bad_token}"):
            trainer.compute_logprobs(datums)
    assert all(p.grad is None for p in trainer.model.parameters())  # refused before any work


def zero_advantage_batch(small_model, char_tokenizer, monkeypatch, loss_fn, first: dict):
    """Two trainers on the same weights, the first with the attributes in ``first`` and the second with one pass
    over everything; three groups of 4, the last two with advantage 0 (every reward equal), after one update, so
    that the ratios are not all 1 (the clip and the ratio matter). Returns (trainers, datums, passes), where each
    training pass appends (by the first trainer?, rows, with a graph?) to ``passes``."""
    service = ServiceClient(device="cpu")
    trainers = [service.create_training_client((small_model, char_tokenizer)) for _ in range(2)]
    for name, value in first.items():
        setattr(trainers[0], name, value)
    trainers[1].skip_zero_advantage = False
    datums = group_datums(trainers[0], [PROMPT, PROMPT[:4], PROMPT[2:] + PROMPT[:3]])
    for d in datums[4:]:
        d.loss_fn_inputs["advantages"] = torch.zeros_like(d.loss_fn_inputs["advantages"])
    trainers[0].forward_backward(datums[:4], loss_fn).result()
    trainers[0].optim_step(AdamParams(learning_rate=1e-2)).result()
    trainers[1].model.load_state_dict(trainers[0].model.state_dict())
    trainers[0].model.zero_grad()
    passes = []
    score = type(trainers[0])._train_logprobs

    def counted(self, ids, *args, **kwargs):
        passes.append((self is trainers[0], len(ids), torch.is_grad_enabled()))
        return score(self, ids, *args, **kwargs)

    monkeypatch.setattr(type(trainers[0]), "_train_logprobs", counted)
    return trainers, datums, passes


@pytest.mark.parametrize(
    "loss_fn, aggregation",
    [("importance_sampling", "token_mean"), ("ppo", "seq_mean_token_mean"), ("cispo", "sum")],
)
def test_datums_with_zero_advantage_skip_the_backward_pass_and_change_nothing(
    small_model, char_tokenizer, monkeypatch, loss_fn, aggregation
):
    """Issue 19: two of three groups have advantage 0 (their rewards were all equal). They are scored without a
    graph, yet the loss (with its denominator), the metrics, the returned log-probs and the gradient are those
    of one pass over the whole batch. A version that dropped them would change the token_mean/seq_mean
    denominators, and with them the gradient."""
    trainers, datums, passes = zero_advantage_batch(small_model, char_tokenizer, monkeypatch, loss_fn, {})
    outs = [t.forward_backward(datums, loss_fn, aggregation=aggregation).result() for t in trainers]
    assert passes == [(True, 8, False), (True, 4, True), (False, 12, True)]
    assert outs[0].loss == pytest.approx(outs[1].loss, rel=1e-5) and outs[0].loss != 0
    assert outs[0].metrics.keys() == outs[1].metrics.keys()
    for key in outs[0].metrics:
        assert outs[0].metrics[key] == pytest.approx(outs[1].metrics[key], rel=1e-4, abs=1e-7), key
    for a, b in zip(outs[0].loss_fn_outputs, outs[1].loss_fn_outputs):
        assert torch.allclose(a["logprobs"], b["logprobs"], atol=1e-5)
    for (name, p), q in zip(trainers[0].model.named_parameters(), trainers[1].model.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-4), name


@pytest.mark.parametrize(
    "loss_fn, aggregation",
    [("importance_sampling", "token_mean"), ("ppo", "seq_mean_token_mean"), ("cispo", "sum")],
)
def test_unscored_zero_advantage_datums_change_neither_the_loss_nor_the_gradient(
    small_model, char_tokenizer, monkeypatch, loss_fn, aggregation
):
    """Issue 19, score_zero_advantage=False: the datums whose advantages are all 0 get no pass at all. The loss
    (its denominator counts their tokens) and the gradient are those of one pass over the whole batch; the metrics
    are those of the scored datums alone, and the others' returned log-probs are NaN. Dropping the datums would
    change the token_mean / seq_mean denominators; metrics over the stand-in rows would pull the KL toward 0."""
    first = {"score_zero_advantage": False}
    trainers, datums, passes = zero_advantage_batch(small_model, char_tokenizer, monkeypatch, loss_fn, first)
    outs = [t.forward_backward(datums, loss_fn, aggregation=aggregation).result() for t in trainers]
    assert passes == [(True, 4, True), (False, 12, True)], "the 8 zero-advantage datums are not scored"
    assert outs[0].loss == pytest.approx(outs[1].loss, rel=1e-5) and outs[0].loss != 0
    for (name, p), q in zip(trainers[0].model.named_parameters(), trainers[1].model.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-4), name
    for a, b in zip(outs[0].loss_fn_outputs[:4], outs[1].loss_fn_outputs[:4]):
        assert torch.allclose(a["logprobs"], b["logprobs"], atol=1e-5)
    assert all(o["logprobs"].isnan().all() for o in outs[0].loss_fn_outputs[4:])
    trainers[1].model.zero_grad()
    scored_only = trainers[1].forward_backward(datums[:4], loss_fn, aggregation=aggregation).result()
    assert outs[0].metrics.keys() == scored_only.metrics.keys()
    for key in outs[0].metrics:
        assert outs[0].metrics[key] == pytest.approx(scored_only.metrics[key], rel=1e-4, abs=1e-7), key
    # and they are not the whole batch's (the updated weights moved the unscored rows' ratios less), so the check
    # above would catch metrics taken over the stand-in rows too
    assert abs(outs[0].metrics["optim/kl_sample_train_v1"] - outs[1].metrics["optim/kl_sample_train_v1"]) > 0.02
    tokens = [int(d.loss_fn_inputs["mask"].sum()) for d in datums]
    assert (outs[0].metric_tokens, outs[1].metric_tokens) == (sum(tokens[:4]), sum(tokens))


def test_unscored_mode_scores_everything_when_every_advantage_is_0_or_the_reference_kl_is_logged(trainer):
    """Nothing to score would leave no graph and no metric; log_kl_ref asks for a metric over every datum."""
    trainer.score_zero_advantage = False
    trainer._reference = copy.deepcopy(trainer.model)
    datums = rl_datums(trainer)
    for d in datums:
        d.loss_fn_inputs["advantages"] = torch.zeros_like(d.loss_fn_inputs["advantages"])
    out = trainer.forward_backward(datums, "importance_sampling").result()
    assert out.loss == 0 and not any(o["logprobs"].isnan().any() for o in out.loss_fn_outputs)
    assert all(p.grad is not None for p in trainer.trainable_parameters())
    datums[0].loss_fn_inputs["advantages"][-1] = 1.0
    out = trainer.forward_backward(datums, "importance_sampling", log_kl_ref=True).result()
    assert not any(o["logprobs"].isnan().any() for o in out.loss_fn_outputs)
    assert out.metric_tokens == sum(int(d.loss_fn_inputs["mask"].sum()) for d in datums)


def test_metric_tokens_count_a_fractional_mask_as_the_metrics_do(trainer):
    # rl_objective counts every nonzero mask entry whole; metric_tokens summed the weights (0.5 + 1 -> 1)
    datums = rl_datums(trainer)
    for d in datums:
        mask = d.loss_fn_inputs["mask"]
        d.loss_fn_inputs["mask"] = torch.where(mask != 0, 0.5, 0.0)
    out = trainer.forward_backward(datums, "importance_sampling").result()
    assert out.metric_tokens == sum(int((d.loss_fn_inputs["mask"] != 0).sum()) for d in datums) > 0


@pytest.mark.parametrize("loss_fn, kl_coef", [("dro", 0.0), ("importance_sampling", 0.1)])
def test_zero_advantage_datums_keep_their_graph_when_their_gradient_is_not_zero(trainer, loss_fn, kl_coef, monkeypatch):
    """DRO's penalty and a KL term in the loss both have a gradient at advantage 0: one pass over every datum."""
    trainer._reference = copy.deepcopy(trainer.model) if kl_coef else None
    datums = rl_datums(trainer)
    for d in datums[2:]:
        d.loss_fn_inputs["advantages"] = torch.zeros_like(d.loss_fn_inputs["advantages"])
    passes = []
    score = type(trainer)._train_logprobs

    def counted(self, ids, *args, **kwargs):
        passes.append((len(ids), torch.is_grad_enabled(), kwargs.get("reference", False)))
        return score(self, ids, *args, **kwargs)

    monkeypatch.setattr(type(trainer), "_train_logprobs", counted)
    trainer.forward_backward(datums, loss_fn, {"beta": 0.1} if loss_fn == "dro" else None, kl_coef=kl_coef).result()
    assert (4, True, False) in passes and all(n == 4 for n, _, _ in passes)


@pytest.mark.skipif(not _ATTENTION_READ_AT_EACH_CALL, reason="this transformers cannot switch attention per call")
def test_forward_backward_scores_short_rows_with_eager_attention_and_puts_sdpa_back(trainer, monkeypatch):
    """edurl.llm.shared_prefix.short_row_attention around the training pass through the model's forward (a model
    that the packed pass does not run, here made so): eager inside, sdpa after."""
    import edurl.llm.shared_prefix as sp

    monkeypatch.setattr(sp, "packed_logits", lambda *args, **kwargs: None)
    datums = rl_datums(trainer)
    model, seen = trainer.model, []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda **kw: seen.append(model.config._attn_implementation) or forward(**kw))
    trainer.forward_backward(datums, "importance_sampling").result()
    assert seen and set(seen) == {"eager"}
    assert model.config._attn_implementation == "sdpa"


def test_a_float64_model_shares_left_padded_prompts_without_nan(small_model, char_tokenizer):
    # the CPU's eager attention for short rows took its softmax in float32, where a float64 mask's lowest value
    # is -inf: the shorter prompt's padding rows became NaN and spread to every log-prob and gradient
    model = copy.deepcopy(small_model).double()
    client = ServiceClient(device="cpu").create_training_client((model, char_tokenizer))
    datums = [
        build_datum(prompt, completion, [-1.0] * len(completion), advantage)
        for prompt in ([10, 11, 12], [20, 21, 22, 23, 24])  # two prompt lengths: the shorter is left-padded
        for completion, advantage in (([30, 31, 32], 1.0), ([33, 34], -1.0))
    ]
    runs = []
    for share in (False, True):
        client.share_prompts = share
        client.model.zero_grad(set_to_none=True)
        out = client.forward_backward(datums, "importance_sampling").result()
        grads = torch.cat([q.grad.flatten() for q in client.model.parameters() if q.grad is not None])
        runs.append((out.loss, torch.cat([o["logprobs"] for o in out.loss_fn_outputs]), grads))
    (loss_whole, lp_whole, g_whole), (loss_shared, lp_shared, g_shared) = runs
    assert math.isfinite(loss_shared) and torch.isfinite(g_shared).all()
    assert loss_shared == pytest.approx(loss_whole, rel=1e-10)
    torch.testing.assert_close(lp_shared, lp_whole, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(g_shared, g_whole, atol=1e-7, rtol=1e-6)  # measured: 5.7e-9 at most


def test_optim_step_refuses_a_non_finite_gradient_and_leaves_the_weights(small_model, char_tokenizer):
    # sampling log-probs of -200 on a token the model gives about -4.6: exp(lp - q) overflows float32, the
    # gradient is inf/nan, and one Adam step would have written nan into every weight
    client = ServiceClient(device="cpu").create_training_client((copy.deepcopy(small_model), char_tokenizer))
    before = [q.detach().clone() for q in client.model.parameters()]
    bad = [build_datum([10, 11, 12], [30, 31], [-200.0, -1.0], 1.0), build_datum([10, 11, 12], [33], [-1.0], -1.0)]
    client.forward_backward(bad, "importance_sampling")
    with pytest.raises(FloatingPointError, match="gradient norm is (nan|inf).*weights were left as they were"):
        client.optim_step(AdamParams(learning_rate=1e-3))
    assert all(torch.equal(a, q) for a, q in zip(before, client.model.parameters()))
    assert all(q.grad is None for q in client.model.parameters())
    good = [build_datum([10, 11, 12], [30, 31], [-4.0, -4.0], 1.0), build_datum([10, 11, 12], [33], [-4.0], -1.0)]
    client.forward_backward(good, "importance_sampling")  # the client goes on from where it was
    norm = client.optim_step(AdamParams(learning_rate=1e-3)).result()["optim/grad_norm"]
    assert math.isfinite(norm) and norm > 0
    assert not all(torch.equal(a, q) for a, q in zip(before, client.model.parameters()))


@pytest.mark.cuda
def test_a_resumed_optimizer_on_cuda_keeps_its_step_counts_on_the_cpu(small_model, char_tokenizer, tmp_path):
    service = ServiceClient(device="cuda", log_dir=tmp_path)
    trainer = service.create_lora_training_client((copy.deepcopy(small_model), char_tokenizer), rank=4)
    datums = rl_datums(trainer)
    trainer.forward_backward(datums, "importance_sampling")
    trainer.optim_step(AdamParams(learning_rate=1e-3))
    path = trainer.save_state("ckpt")
    trainer.load_state(path)  # torch.load(map_location="cuda") put Adam's step counts on the GPU: a sync per read
    assert all(s["step"].device.type == "cpu" for s in trainer.optimizer.state.values())
    trainer.forward_backward(datums, "importance_sampling")
    trainer.optim_step(AdamParams(learning_rate=1e-3))


def test_load_state_refuses_a_checkpoint_that_does_not_cover_the_model(small_model, char_tokenizer, tmp_path):
    # a q_proj-only adapter's checkpoint used to load into an all-module adapter (24 of 28 tensors left as they
    # were), and a rank-4 adapter's failed inside copy_ after some tensors had been overwritten
    service = ServiceClient(device="cpu", log_dir=tmp_path)

    def lora(rank, **kw):
        torch.manual_seed(0)
        return service.create_lora_training_client((copy.deepcopy(small_model), char_tokenizer), rank=rank, **kw)

    path = lora(4, target_modules=("q_proj",)).save_state("q_only")
    everywhere = lora(4)
    before = {k: v.clone() for k, v in everywhere.model.named_parameters()}
    with pytest.raises(ValueError, match=r"lacks \d+ of this model's \d+ trainable weights .*another LoRA adapter"):
        everywhere.load_state(path)
    wider = lora(8, target_modules=("q_proj",))
    wider_before = {k: v.clone() for k, v in wider.model.named_parameters()}
    with pytest.raises(ValueError, match=r"another shape than this model's .*\(4, 32\) saved, \(8, 32\) here.*Nothing"):
        wider.load_state(path)
    for client, kept in ((everywhere, before), (wider, wider_before)):  # nothing was half loaded
        assert all(torch.equal(v, kept[k]) for k, v in client.model.named_parameters())
    lora(4, target_modules=("q_proj",)).load_state(path)  # the model it came from loads it


def test_datums_with_other_fields_than_the_first_are_refused_by_index_and_field(trainer):
    """Only datums[0] had "weights": check_inputs (the server's 400) let it through, and forward_backward then
    failed with a bare KeyError('weights') while padding, which the server took for a broken model."""
    datums = rl_datums(trainer, n=2)
    datums[0].loss_fn_inputs["weights"] = torch.ones(datums[0].model_input.length)
    for call in (trainer.check_inputs, trainer.forward_backward):
        with pytest.raises(ValueError, match=r"datums\[1\]\.loss_fn_inputs lacks \['weights'\], which datums\[0\] has"):
            call(datums, "importance_sampling")
    assert all(p.grad is None for p in trainer.model.parameters())
    datums = rl_datums(trainer, n=2)
    datums[1].loss_fn_inputs["weights"] = torch.ones(datums[1].model_input.length)
    with pytest.raises(ValueError, match=r"datums\[1\]\.loss_fn_inputs has \['weights'\], which datums\[0\] lacks"):
        trainer.check_inputs(datums, "importance_sampling")


def test_load_state_drops_the_gradients_taken_before_it(trainer, tmp_path):
    """forward_backward, load_state, forward_backward, optim_step stepped on the sum of both gradients: the first
    one was taken at weights the checkpoint replaced. The step must be the one a clean resume takes."""
    trainer.log_dir = tmp_path
    datums, other = rl_datums(trainer, seed=0), rl_datums(trainer, seed=1)
    trainer.forward_backward(datums, "importance_sampling")
    trainer.optim_step(AdamParams(learning_rate=1e-2))
    path = trainer.save_state("ckpt")

    def step_from_checkpoint():
        trainer.load_state(path)
        trainer.forward_backward(datums, "importance_sampling")
        trainer.optim_step(AdamParams(learning_rate=1e-2))
        return [p.detach().clone() for p in trainer.model.parameters()]

    clean = step_from_checkpoint()
    trainer.forward_backward(other, "ppo")  # computed, then rolled back instead of stepped on
    trainer.load_state(path)
    assert all(p.grad is None for p in trainer.model.parameters())
    with pytest.raises(RuntimeError, match="found no gradients"):
        trainer.optim_step(AdamParams(learning_rate=1e-2))
    trainer.forward_backward(other, "ppo")
    after = step_from_checkpoint()
    assert all(torch.equal(a, b) for a, b in zip(clean, after))


def test_cross_entropy_refuses_a_loss_fn_config(trainer):
    """cross_entropy returned before the config's keys were checked: {"clip_low_threshold": 0.5, "bogus": 1} ran
    as if it had not been sent."""
    tokens = PROMPT + [5, 6, 7]
    d = Datum(
        ModelInput.from_ints(tokens[:-1]),
        {"target_tokens": torch.tensor(tokens[1:]), "weights": torch.tensor([0.0] * 8 + [1.0] * 3)},
    )
    for call in (trainer.check_inputs, trainer.forward_backward, trainer.forward):
        with pytest.raises(ValueError, match=r"\['bogus'\], which 'cross_entropy' does not take"):
            call([d], "cross_entropy", {"bogus": 1})
    assert all(p.grad is None for p in trainer.model.parameters())
    trainer.check_inputs([d], "cross_entropy", {})  # an empty config is no config


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"eps": -1e-3}, "eps must be a finite number > 0"),
        ({"eps": 0.0}, "eps must be a finite number > 0"),
        ({"eps": float("nan")}, "eps must be a finite number > 0"),
        ({"weight_decay": -100.0}, "weight_decay must be a finite number >= 0"),
        ({"weight_decay": float("inf")}, "weight_decay must be a finite number >= 0"),
    ],
)
def test_adam_params_refuse_a_bad_eps_or_weight_decay(kwargs, match):
    """torch checks them only when AdamW is built, at the first step: from the second step on, eps=-1e-3 and
    weight_decay=-100 ran silently."""
    with pytest.raises(ValueError, match=match):
        AdamParams(**kwargs)
