"""Flex's training path, which only a GPU runs, traced on the CPU (tests/model/test_flex_backward.py says how): the
model's flex kernels compiled by AOT autograd with each flex backward's score_mod graphs put through inductor's
own check, as a GPU's torch.compile would."""

import pytest
import torch

import model as model_module


def private_apis():
    """inductor's check, AOT autograd's backend factory and flex's device check, or a skip naming what moved."""
    try:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd
        from torch._inductor.kernel.flex.flex_attention import validate_joint_graph
        from torch.nn.attention import flex_attention as flex_module

        flex_module._validate_device  # noqa: B018 (only its presence is asked)
        backward_op = torch.ops.higher_order.flex_attention_backward
    except (ImportError, AttributeError) as e:
        pytest.skip(f"torch {torch.__version__} moved a private API this check reads: {e}")
    return aot_autograd, make_boxed_func, validate_joint_graph, flex_module, backward_op


def validating_backend(aot_autograd, make_boxed_func, validate_joint_graph, backward_op, checked):
    """AOT autograd with the graphs run as traced; each flex backward's score_mod graphs go through inductor's
    validation as inductor's lowering puts them (dead code removed first), counted in `checked`."""

    def backward(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.target is backward_op:
                for arg in node.args:  # the score_mod's forward and joint graphs are the HOP's get_attr arguments
                    if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
                        graph = getattr(gm, arg.target).graph
                        graph.eliminate_dead_code()
                        validate_joint_graph(graph)
                checked.append(node)
        return make_boxed_func(gm)

    return aot_autograd(fw_compiler=lambda gm, example_inputs: make_boxed_func(gm), bw_compiler=backward)


def take_flex(monkeypatch, model):
    """`model` (returned) takes flex for every forward, training included, as a GPU does; on the CPU
    model.attention_path refuses flex training for lack of a backward. Other models keep the policy."""
    policy = model_module.attention_path
    monkeypatch.setattr(model_module, "attention_path",
                        lambda m, *args: "flex" if m is model else policy(m, *args))
    return model


def trace_flex_as_a_gpu(monkeypatch):
    """From here on, torch.compile (and so every flex kernel the model makes) traces with the validating
    backend, and flex accepts CPU inputs with gradients. Returns the list each traced flex backward is added
    to, so a test can assert one was traced."""
    aot_autograd, make_boxed_func, validate_joint_graph, flex_module, backward_op = private_apis()
    checked = []
    backend = validating_backend(aot_autograd, make_boxed_func, validate_joint_graph, backward_op, checked)
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **options: compile_(fn, **{**options, "backend": backend}))
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)
    if not hasattr(model_module, "_FLEX_KERNELS"):
        pytest.fail("model._FLEX_KERNELS is gone: give this test the new home of the compiled flex kernels")
    monkeypatch.setattr(model_module, "_FLEX_KERNELS", {})  # kernels compiled here, by the backend above
    torch._dynamo.reset()
    return checked
