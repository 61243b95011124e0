"""Models no one here wrote: GPT-2 and BERT from the `transformers` package, built from small
configs (nothing downloaded), train with hookprof attached exactly as without it, and every
parameter is covered by a layer whose gradient norm matches an independent computation."""

from __future__ import annotations

import pytest
import torch

from support.models import run_optionally_profiled

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 97, 16, 4


def gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2
    )
    return transformers.GPT2LMHeadModel(config)  # lm_head is tied to wte


def bert():
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
    )
    return transformers.BertForMaskedLM(config)


def run(build, steps: int, settings: dict | None):
    torch.manual_seed(0)
    model = build()
    model.train()  # dropout on: hookprof must not touch the RNG stream
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train_step():
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    prof, snap, _ = run_optionally_profiled(model, settings, steps, train_step)
    return model, prof, snap


@pytest.mark.parametrize("build", [gpt2, bert], ids=["gpt2", "bert"])
def test_bit_identical_training_full_coverage_and_exact_norms(build, every_step):
    reference, _, _ = run(build, 6, None)
    model, prof, snap = run(build, 6, every_step)

    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name

    # every parameter (tied weights once) belongs to exactly one layer
    covered = [id(p) for p in prof.table.params]
    assert len(covered) == len(set(covered))
    assert set(covered) == {id(p) for p in model.parameters()}

    # per-layer norms against torch.linalg.vector_norm of the gradients the last step left
    for layer in prof.table.layers:
        grads = [prof.table.params[i].grad for i in layer.param_indices]
        grads = [g for g in grads if g is not None]
        if not grads:
            continue
        expected = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.double()) for g in grads])
        )
        assert snap.layers[layer.name].grad_norm == pytest.approx(expected.item(), rel=1e-5), (
            layer.name
        )
    total = torch.nn.utils.get_total_norm(
        [p.grad for p in model.parameters() if p.grad is not None]
    )
    assert snap.grad_norm == pytest.approx(total.item(), rel=1e-5)

    # forward and backward times came from the real layers
    timed = [s for s in snap.layers.values() if s.forward_seconds > 0]
    assert len(timed) >= len(snap.layers) // 2
    assert sum(s.backward_calls_total for s in snap.layers.values()) > 0
    assert snap.step == 6 and snap.nonfinite_steps == {"forward": 0, "backward": 0, "loss": 0}
