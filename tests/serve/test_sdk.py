"""The official tinker SDK against edurl.serve: the public-contract path, on-policy log-probs, checkpoints."""

from __future__ import annotations

import math

import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from edurl.recipes.tinker_rl_loop import make_datum  # noqa: E402

from .conftest import KEY  # noqa: E402

PROMPT = "<|im_start|>user\n27+58=?<|im_end|>\n<|im_start|>assistant\n"


def rl_datum(prompt: list[int], seq, advantage: float) -> types.Datum:
    return make_datum(prompt, list(seq.tokens), list(seq.logprobs), advantage)


@pytest.fixture
def service(server_url):
    """A session of the test's own, closed when the test ends, passed or failed (not left for the server to expire
    600 s after the last heartbeat, under another test that counts sessions)."""
    client = tinker.ServiceClient(base_url=server_url, api_key=KEY)
    yield client
    client.close("success").result()


@pytest.fixture(scope="module")
def training(server_url):
    service = tinker.ServiceClient(base_url=server_url, api_key=KEY)
    client = service.create_lora_training_client(base_model="edurl/tiny-arithmetic", rank=8).result()
    yield service, client
    service.close("success").result()  # not left for the server to expire 600 s after the last heartbeat


def test_train_and_sample_through_the_sdk_on_policy(training):
    _, tc = training
    tokenizer = tc.get_tokenizer()  # AutoTokenizer on the folder that get_info names: offline
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=16, temperature=1.0)
    res = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=4, sampling_params=params).result()
    assert len(res.sequences) == 4
    assert all(len(s.logprobs) == len(s.tokens) > 0 for s in res.sequences)
    assert all(s.stop_reason in ("stop", "length") for s in res.sequences)

    datums = [rl_datum(prompt, s, adv) for s, adv in zip(res.sequences, (1.0, -1.0, 0.5, -0.5))]
    out = tc.forward_backward(datums, loss_fn="importance_sampling").result()
    n_prompt = len(prompt) - 1
    for seq, o in zip(res.sequences, out.loss_fn_outputs):
        train = o["logprobs"].to_torch()[n_prompt:]
        assert torch.allclose(train, torch.tensor(seq.logprobs), atol=1e-4), "on-policy: training = sampling log-probs"
    assert math.isfinite(out.metrics["loss:sum"])

    before = [o["logprobs"].to_torch() for o in out.loss_fn_outputs]
    step = tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert step is not None
    after = tc.forward(datums, loss_fn="importance_sampling").result()
    moved = max(float((o["logprobs"].to_torch() - b).abs().max()) for o, b in zip(after.loss_fn_outputs, before))
    assert moved > 1e-4, "optim_step changed the weights the next forward pass sees"


def test_save_state_and_load_state_round_trip(training):
    _, tc = training
    tokenizer = tc.get_tokenizer()
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    probe = [
        types.Datum(
            model_input=types.ModelInput.from_ints(prompt[:-1]),
            loss_fn_inputs={"target_tokens": prompt[1:], "weights": [1.0] * (len(prompt) - 1)},
        )
    ]
    saved = tc.save_state("ckpt").result()
    assert saved.path.startswith("tinker://")
    lp_saved = tc.forward(probe, loss_fn="cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
    tc.forward_backward(probe, loss_fn="cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    lp_moved = tc.forward(probe, loss_fn="cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
    assert not torch.allclose(lp_moved, lp_saved, atol=1e-5)
    tc.load_state(saved.path).result()
    lp_loaded = tc.forward(probe, loss_fn="cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
    assert torch.allclose(lp_loaded, lp_saved, atol=1e-6)


def test_a_wrong_key_is_refused_by_the_sdk(server_url):
    service = tinker.ServiceClient(base_url=server_url, api_key="tml-not-the-key")
    with pytest.raises(tinker.AuthenticationError):
        service.create_lora_training_client(base_model="edurl/tiny-arithmetic", rank=8).result()


def test_named_sampler_weights_compute_logprobs_and_a_client_from_state(training):
    service, tc = training
    tokenizer = tc.get_tokenizer()
    prompt = tokenizer.encode(PROMPT + "85", add_special_tokens=False)
    probe = [
        types.Datum(
            model_input=types.ModelInput.from_ints(prompt[:-1]),
            loss_fn_inputs={"target_tokens": prompt[1:], "weights": [1.0] * (len(prompt) - 1)},
        )
    ]
    train_lp = tc.forward(probe, loss_fn="cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()

    path = tc.save_weights_for_sampler("named").result().path
    sampler = service.create_sampling_client(model_path=path)
    prompt_lp = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    assert prompt_lp[0] is None  # the first token has no context
    assert torch.allclose(torch.tensor(prompt_lp[1:]), train_lp, atol=1e-4)

    saved = tc.save_state("for-a-new-client").result().path
    other = service.create_training_client_from_state(saved)
    other_lp = other.forward(probe, loss_fn="cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
    assert torch.allclose(other_lp, train_lp, atol=1e-6)


@pytest.mark.parametrize(
    "loss_fn, config",
    [("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}), ("cispo", None), ("dro", {"beta": 0.1})],
)
def test_every_rl_loss_runs_through_the_sdk(training, loss_fn, config):
    _, tc = training
    tokenizer = tc.get_tokenizer()
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    sampler = tc.save_weights_and_get_sampling_client().result()
    res = sampler.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=8)).result()
    datums = [rl_datum(prompt, s, a) for s, a in zip(res.sequences, (1.0, -1.0))]
    out = tc.forward_backward(datums, loss_fn=loss_fn, loss_fn_config=config).result()
    assert math.isfinite(out.metrics["loss:sum"]) and len(out.loss_fn_outputs) == 2


def test_an_unknown_loss_is_refused_with_the_list(training):
    _, tc = training
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    with pytest.raises(tinker.BadRequestError, match="importance_sampling"):
        tc.forward_backward([datum], loss_fn="gspo").result()
    # the refused call used up its seq_id: the client's next operation runs instead of waiting for it
    out = tc.forward([datum], loss_fn="cross_entropy").result(timeout=60)
    assert len(out.loss_fn_outputs) == 1


def test_a_seeded_client_takes_the_same_step_as_the_in_process_one(service):
    """The seed reaches the LoRA initialisation (the SDK sends it inside lora_config), so the same datums give
    the same gradient norm and the same weights after one step, through HTTP and in process."""
    from edurl.llm.clients import AdamParams, ServiceClient
    from edurl.llm.datum import build_datum
    from edurl.llm.sft import load_or_train_sft

    model, tokenizer, _, _ = load_or_train_sft(progress=False)
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    completion = tokenizer.encode("\\boxed{85}<|im_end|>", add_special_tokens=False)
    torch.manual_seed(0)
    local = ServiceClient(device="cpu").create_lora_training_client((model, tokenizer), rank=8)
    probe = build_datum(prompt, completion, [0.0] * len(completion), 0.0)
    lp = local.compute_logprobs([probe])[0][len(prompt) - 1 :].tolist()
    datums = [build_datum(prompt, completion, lp, 1.0), build_datum(prompt, completion[:3], lp[:3], -1.0)]
    sdk_datums = [
        types.Datum(
            model_input=types.ModelInput.from_ints(d.model_input.to_ints()),
            loss_fn_inputs={k: d.loss_fn_inputs[k].tolist() for k in ("target_tokens", "logprobs", "advantages")},
        )
        for d in datums
    ]
    remote = service.create_lora_training_client(base_model="edurl/tiny-arithmetic", rank=8, seed=0).result()
    adam = dict(learning_rate=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=1.0)
    local.forward_backward(datums, "importance_sampling").result()
    local_norm = local.optim_step(AdamParams(**adam)).result()["optim/grad_norm"]
    remote.forward_backward(sdk_datums, loss_fn="importance_sampling").result()
    remote_norm = remote.optim_step(types.AdamParams(**adam)).result().metrics["optim/grad_norm"]
    assert remote_norm == pytest.approx(local_norm, rel=1e-5)
    after_local = local.compute_logprobs(datums)
    after_remote = remote.forward(sdk_datums, loss_fn="importance_sampling").result().loss_fn_outputs
    for d, lo, re in zip(datums, after_local, after_remote):
        m = d.loss_fn_inputs["mask"].bool()
        assert torch.allclose(re["logprobs"].to_torch()[m], lo[m], atol=1e-5)


def test_dro_sums_over_every_position_as_tinker_writes_it_and_a_mask_narrows_it(service):
    # Tinker's documentation writes dro as -sum(lp * A - beta / 2 * (lp - q)**2) over all N positions, so a
    # maskless datum's prompt (q = 0 there) is penalised too; edurl.serve keeps that, and takes an optional
    # "mask" input (an edurl extension) that restricts the sum to the positions where it is 1
    tc = service.create_lora_training_client(base_model="edurl/tiny-arithmetic", rank=8).result()
    prompt = tc.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=0)
    seq = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
    n_prompt, n = len(prompt) - 1, len(seq.tokens)
    q = torch.tensor([0.0] * n_prompt + list(seq.logprobs), dtype=torch.float64)
    adv = torch.tensor([0.0] * n_prompt + [0.5] * n, dtype=torch.float64)
    mask = torch.tensor([0.0] * n_prompt + [1.0] * n, dtype=torch.float64)
    beta = 0.1

    def dro_loss(datum):
        out = tc.forward_backward([datum], loss_fn="dro", loss_fn_config={"beta": beta}).result()
        return out.metrics["loss:sum"], out.loss_fn_outputs[0]["logprobs"].to_torch().double()

    plain = rl_datum(prompt, seq, 0.5)
    loss, lp = dro_loss(plain)
    per_token = -(lp * adv - 0.5 * beta * (lp - q) ** 2)
    assert loss == pytest.approx(float(per_token.sum()), rel=1e-4)
    masked = types.Datum(model_input=plain.model_input, loss_fn_inputs={**plain.loss_fn_inputs, "mask": mask.float()})
    loss_masked, _ = dro_loss(masked)
    assert loss_masked == pytest.approx(float((per_token * mask).sum()), rel=1e-4)
    assert loss - loss_masked > 0.05 * beta  # the prompt's penalty: log-probs there are far from 0


def test_bad_requests_are_refused_when_sent_and_leave_the_model_working(training):
    # each of these once failed inside the operation, and every later operation of the model failed with it;
    # an optimizer other than Adam was run as AdamW with edurl's defaults
    service, tc = training
    good = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    outside = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 10**6, 4], "weights": [1.0, 1.0, 1.0]},
    )
    with pytest.raises(tinker.BadRequestError, match="outside the model's vocabulary"):
        tc.forward_backward([outside], loss_fn="cross_entropy").result()
    rl = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "logprobs": [0.0, -1.0, -1.0], "advantages": [0.0, 1.0, 1.0]},
    )
    with pytest.raises(tinker.BadRequestError, match="does not take"):
        tc.forward_backward([rl], loss_fn="ppo", loss_fn_config={"clip_low": 0.8}).result()
    with pytest.raises(tinker.BadRequestError, match="needs \\['beta'\\]"):  # dro's beta has no default
        tc.forward_backward([rl], loss_fn="dro").result()
    with pytest.raises(tinker.BadRequestError, match="no checkpoint"):
        tc.load_state(f"tinker://{tc.model_id}/weights/never-saved").result()
    with pytest.raises(tinker.BadRequestError, match="Adam only"):
        tc.optim_step(types.DimuonParams(learning_rate=0.5)).result()
    with pytest.raises(tinker.BadRequestError, match="AdamW only|train_mlp"):
        service.create_lora_training_client(base_model="edurl/tiny-arithmetic", rank=8, train_mlp=False).result()
    tc.forward_backward([good], loss_fn="cross_entropy").result(timeout=60)
    assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60) is not None


def test_a_refused_step_leaves_the_model_working(training):
    """An optim_step with no gradients, and one whose gradient norm is nan (nan advantages: (r - mean) / std on a
    group of equal rewards), change no weight, but they marked the model broken: every later operation failed,
    save_state too. A model_input id outside the vocabulary reached the embedding (IndexError) and broke it as
    well; now it is a 400."""
    _, tc = training
    good = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    with pytest.raises(Exception, match="found no gradients"):
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)
    nan = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={
            "target_tokens": [2, 3, 4],
            "logprobs": [0.0, -1.0, -1.0],
            "advantages": [0.0, float("nan"), float("nan")],
        },
    )
    tc.forward_backward([nan], loss_fn="importance_sampling").result(timeout=60)
    with pytest.raises(Exception, match="gradient norm is nan"):
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)
    outside = types.Datum(
        model_input=types.ModelInput.from_ints([1, 5000, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    with pytest.raises(tinker.BadRequestError, match="model_input token 1 is id 5000"):
        tc.forward_backward([outside], loss_fn="cross_entropy").result(timeout=60)
    tc.forward_backward([good], loss_fn="cross_entropy").result(timeout=60)
    assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60) is not None


def test_forward_gives_forward_backwards_loss(training):
    _, tc = training  # forward's loss was once reported as 0.0
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    only = tc.forward([datum], loss_fn="cross_entropy").result()
    both = tc.forward_backward([datum], loss_fn="cross_entropy").result()
    assert only.metrics["loss:sum"] == pytest.approx(both.metrics["loss:sum"]) and only.metrics["loss:sum"] > 0
    tc.optim_step(types.AdamParams(learning_rate=0.0)).result()  # the gradient of forward_backward, cleared


def test_checkpoint_names_are_kept_apart(training):
    _, tc = training  # 'run/1' and 'run_1' once shared a folder, and a second save replaced the first
    tc.save_state("unique-name").result()
    with pytest.raises(tinker.BadRequestError, match="exists"):
        tc.save_state("unique-name").result()
    assert tc.save_state("unique-name", overwrite=True).result().path.endswith("/weights/unique-name")
    with pytest.raises(tinker.BadRequestError, match="letters, digits"):
        tc.save_state("run/1").result()


def test_fields_edurl_serve_would_ignore_are_refused(training):
    _, tc = training  # per-token clip thresholds and top-k log-probs were once accepted and ignored
    tokenizer = tc.get_tokenizer()
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    clipped = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={
            "target_tokens": [2, 3, 4],
            "logprobs": [0.0, -1.0, -1.0],
            "advantages": [0.0, 1.0, 1.0],
            "clip_low_threshold": [0.8, 0.8, 0.8],
        },
    )
    with pytest.raises(tinker.BadRequestError, match="clip_low_threshold"):
        tc.forward_backward([clipped], loss_fn="ppo").result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.BadRequestError, match="topk_sample_logprobs"):
        sampler.sample(
            types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=4), topk_sample_logprobs=3
        ).result()


def test_a_batch_whose_datums_differ_in_fields_is_a_400_and_the_model_can_still_save(service):
    """Only datum 0 had "weights": it passed the submit-time checks, then failed inside the operation with a bare
    KeyError('weights'), which marked the model broken: every later forward_backward and save_state failed, so the
    weights trained so far could not be saved. A cross_entropy config and an AdamParams out of range were accepted."""
    tc = service.create_lora_training_client(base_model="edurl/tiny-arithmetic", rank=8).result()
    rl = {"target_tokens": [2, 3, 4], "logprobs": [0.0, -1.0, -1.0], "advantages": [0.0, 1.0, 1.0]}
    plain = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs=rl)
    weighted = types.Datum(model_input=plain.model_input, loss_fn_inputs={**rl, "weights": [1.0, 1.0, 1.0]})
    with pytest.raises(tinker.BadRequestError, match=r"datums\[1\].loss_fn_inputs lacks \['weights'\]"):
        tc.forward_backward([weighted, plain], loss_fn="importance_sampling").result(timeout=60)
    sft = types.Datum(
        model_input=plain.model_input, loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]}
    )
    with pytest.raises(tinker.BadRequestError, match="'cross_entropy' does not take"):
        tc.forward_backward([sft], loss_fn="cross_entropy", loss_fn_config={"bogus": 1.0}).result(timeout=60)
    tc.forward_backward([plain, plain], loss_fn="importance_sampling").result(timeout=60)
    for bad, match in ((dict(eps=-1e-3), "eps must be"), (dict(weight_decay=-100.0), "weight_decay must be")):
        with pytest.raises(tinker.BadRequestError, match=match):
            tc.optim_step(types.AdamParams(learning_rate=1e-3, **bad)).result(timeout=60)
    assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60) is not None
    assert tc.save_state("after-a-refused-batch").result(timeout=60).path.endswith("/after-a-refused-batch")


@pytest.mark.filterwarnings("ignore:DEPRECATED:FutureWarning")  # the SDK's load_state*, still served
def test_load_state_drops_the_gradients_of_a_forward_backward_before_it(service):
    """forward_backward, load_state, forward_backward, optim_step stepped on both gradients, the first of them
    taken at the weights the checkpoint replaced: the step differed from a clean resume's."""
    tc = service.create_lora_training_client(base_model="edurl/tiny-arithmetic", rank=8, seed=0).result()
    prompt = tc.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    x = [make_datum(prompt, [5, 6, 7], [-1.0, -2.0, -1.5], a) for a in (1.0, -0.5)]
    y = [make_datum(prompt, [8, 9], [-1.0, -2.0], a) for a in (1.0, -0.5)]
    adam = types.AdamParams(learning_rate=1e-2)
    tc.forward_backward(x, loss_fn="importance_sampling").result()
    tc.optim_step(adam).result()
    path = tc.save_state("before-the-rollback").result().path

    def step_from_checkpoint():
        tc.load_state_with_optimizer(path).result()
        tc.forward_backward(x, loss_fn="importance_sampling").result()
        tc.optim_step(adam).result()
        out = tc.forward(x, loss_fn="importance_sampling").result()
        return [o["logprobs"].to_torch() for o in out.loss_fn_outputs]

    clean = step_from_checkpoint()
    tc.forward_backward(y, loss_fn="ppo").result()  # computed, then rolled back instead of stepped on
    tc.load_state_with_optimizer(path).result()
    with pytest.raises(tinker.RequestFailedError, match="found no gradients"):
        tc.optim_step(adam).result(timeout=60)
    tc.forward_backward(y, loss_fn="ppo").result()
    after = step_from_checkpoint()
    assert all(torch.equal(a, b) for a, b in zip(clean, after))


@pytest.mark.parametrize("bad_at", [0, -1])
def test_a_refused_datum_in_a_batch_the_sdk_once_split_refuses_the_whole_batch(service, bad_at):
    """The SDK splits a forward_backward into chunks of 1024 datums, each its own request and seq_id. With the bad
    datum in the first chunk, the second chunk ran and its gradient stayed for the next optim_step; with it in the
    last chunk, the SDK never sent the first, and the server waited for its seq_id for ever (every later operation
    hung). Now the server has the SDK send such a call as one request: one 400, and nothing runs."""
    tc = service.create_lora_training_client(base_model="edurl/tiny-arithmetic", rank=8).result()
    prompt = tc.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    good = make_datum(prompt, [5, 6, 7], [-1.0, -1.0, -1.0], 1.0)
    targets = list(good.loss_fn_inputs["target_tokens"].data)
    bad = types.Datum(
        model_input=good.model_input,
        loss_fn_inputs={**good.loss_fn_inputs, "target_tokens": targets[:-1] + [10**6]},
    )
    batch = [good] * 1030
    batch[bad_at] = bad
    with pytest.raises(tinker.BadRequestError, match=rf"datums\[{bad_at % 1030}\].*outside the model's vocabulary"):
        tc.forward_backward(batch, loss_fn="importance_sampling").result(timeout=60)
    with pytest.raises(tinker.RequestFailedError, match="found no gradients"):  # nothing of the batch ran
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=30)
    tc.forward_backward([good] * 4, loss_fn="importance_sampling").result(timeout=30)
    assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=30) is not None
