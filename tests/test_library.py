"""fnmoe as a library, from Python: the README's example as written, the planner's validation, the
loss's defaults and what value_and_grad hands back. Legend: B batch, L sequence, V vocab."""
import dataclasses
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fnmoe
from fnmoe.plan.summary import plan

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_library_example_runs_as_written():
    text = (ROOT / "README.md").read_text()
    code = re.search(r"## Library use\n.*?```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert torch.isfinite(scope["loss"]) and scope["run"].name == "tiny"


def test_plan_refuses_a_config_that_validate_refuses():
    """From Python as from the CLI: no numbers for a layout train would refuse (8 experts on 3 ep ranks)."""
    run = fnmoe.load_config("tiny")
    bad = dataclasses.replace(run, mesh=dataclasses.replace(run.mesh, ep=3),
                              train=dataclasses.replace(run.train, batch_size=48))
    with pytest.raises(ValueError, match=r"model.moe.n_experts=8 must be a positive multiple of mesh.ep=3"):
        plan(bad)
    assert plan(run, as_built=False)["total_params"] > 0


def test_loss_fn_divides_by_the_batchs_own_label_count_by_default():
    """Without n_global the cross-entropy part is the mean over the labels that are not ignored,
    as F.cross_entropy's; a count passed is what divides it."""
    run = fnmoe.load_config("tiny")
    params = fnmoe.init_params(run.model, seed=0)
    tokens_BL = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    inputs_BL, labels_BL = tokens_BL[:, :-1], tokens_BL[:, 1:].clone()
    labels_BL[0, :5] = -100
    loss, aux = fnmoe.loss_fn(params, inputs_BL, labels_BL, run.model)
    logits_BLV, _ = fnmoe.forward(params, inputs_BL, run.model)
    want = F.cross_entropy(logits_BLV.flatten(0, 1), labels_BL.flatten(), ignore_index=-100)
    torch.testing.assert_close(aux["ce_loss"], want)
    _, twice = fnmoe.loss_fn(params, inputs_BL, labels_BL, run.model, 2 * int((labels_BL != -100).sum()))
    torch.testing.assert_close(twice["ce_loss"], want / 2)


def test_value_and_grad_returns_the_aux_detached():
    run = fnmoe.load_config("tiny")
    params = fnmoe.init_params(run.model, seed=0)
    tokens_BL = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    (loss, aux), _ = fnmoe.value_and_grad(fnmoe.loss_fn, has_aux=True)(params, tokens_BL[:, :-1], tokens_BL[:, 1:],
                                                                      run.model)
    tensors = {k: v for k, v in aux.items() if isinstance(v, torch.Tensor)}
    assert "balance_loss" in tensors and not any(v.requires_grad for v in tensors.values())
    assert not loss.requires_grad
