"""Flex's training path, which only a GPU runs, traced on the CPU (tests/model/test_flex_backward.py says how): the
model's flex kernels compiled by AOT autograd with each flex backward's score_mod graphs put through inductor's
own check, as a GPU's torch.compile would; and flex's dense backward, which runs that backward on the CPU, giving
a gradient to the captured tensors the GPU's kernel gives one to (flex_backward_as_inductor_lowers_it)."""

import inspect

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


# The score_mod's own inputs (score, b, h, q_idx, kv_idx): the joint graph's outputs are their gradients, then one
# per captured tensor, None where that tensor gets none. Inductor's lowering of flex's backward reads the captured
# tensors' part from there (process_joint_outputs: all_joint_outputs[num_placeholders - 1:]).
SCORE_MOD_INPUTS = 5


def captured_tensors_given_a_gradient(joint_graph, count):
    """For each of the `count` tensors a score_mod captured, whether the traced `joint_graph` (a GraphModule)
    returns a gradient for it: what decides, on a GPU, which captured tensors flex's backward writes a gradient
    to."""
    gradients = joint_graph.graph.output_node().args[0]
    if len(gradients) != SCORE_MOD_INPUTS + count:
        raise RuntimeError(f"flex's joint graph returns {len(gradients)} gradients for {count} captured tensors, "
                           f"not {SCORE_MOD_INPUTS} + {count}: torch {torch.__version__} changed its layout; "
                           "update tests/flex_on_cpu.py")
    return [gradient is not None for gradient in gradients[SCORE_MOD_INPUTS:]]


def dense_backward_apis():
    """flex's backward op, the dispatch key of its dense kernel, that kernel and its signature, once the joint
    graph's layout that captured_tensors_given_a_gradient reads is confirmed on one flex makes; or a skip naming
    what moved."""
    moved = f"torch {torch.__version__} moved a private API of flex's backward this check reads"
    try:
        from torch._C import DispatchKey
        from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
        from torch._higher_order_ops.flex_attention import create_fw_bw_graph

        backward_op = torch.ops.higher_order.flex_attention_backward
        kernel = backward_op.py_kernels.get(DispatchKey.CompositeExplicitAutograd)
        backward_op._dispatch_cache  # noqa: B018 (only its presence is asked)
    except (ImportError, AttributeError) as e:
        pytest.skip(f"{moved}: {e}")
    if kernel is None:
        pytest.skip(f"{moved}: flex_attention_backward has no CompositeExplicitAutograd kernel")
    signature = inspect.signature(kernel)
    missing = {"joint_graph", "score_mod_other_buffers"} - set(signature.parameters)
    if missing:
        pytest.skip(f"{moved}: its CompositeExplicitAutograd kernel has no argument {sorted(missing)}")
    # the joint graph's layout, read as the wrapper reads it, on a score_mod capturing a tensor with a gradient
    # and one without
    with_gradient, without = torch.zeros(3, requires_grad=True), torch.zeros(3)
    example = (torch.zeros((), requires_grad=True), *(torch.zeros((), dtype=torch.int) for _ in range(4)))
    try:
        with TransformGetItemToIndex():  # as flex traces a score_mod: a tensor index stays in the graph
            _, joint_graph = create_fw_bw_graph(lambda score, b, h, q_idx, kv_idx, a, c: score * a[q_idx] + c[kv_idx],
                                                example, (with_gradient, without))
        layout = captured_tensors_given_a_gradient(joint_graph, 2)
    except (TypeError, AttributeError, RuntimeError) as e:
        pytest.skip(f"{moved}: {e}")
    if layout != [True, False]:
        pytest.skip(f"{moved}: its joint graph gives gradients to {layout} of two captured tensors, "
                    "not [True, False]")
    return backward_op, DispatchKey.CompositeExplicitAutograd, kernel, signature


def flex_backward_as_inductor_lowers_it(monkeypatch):
    """From here on, flex's dense backward (the kernel that runs flex's backward on a CPU) gives a gradient to
    exactly the captured tensors the joint graph traced with the forward gives one to, as inductor's lowering
    does on a GPU. Left alone, it asks whether each tensor requires grad when the backward runs: in a compiled
    backward a tensor computed inside the graph (SSMax's factor table) arrives detached, so it returns None for
    a gradient the backward graph then uses ("Expected a proper Tensor but got None"), while a graph input (a
    prior's distance table) keeps its flag and gets one."""
    backward_op, key, dense_backward, signature = dense_backward_apis()

    def as_traced(tensor, gets_gradient):
        if not isinstance(tensor, torch.Tensor) or tensor.requires_grad == gets_gradient:
            return tensor
        return tensor.detach().requires_grad_(gets_gradient)  # the kernel reads the flag, not a graph

    def backward(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        joint_graph, captured = call.arguments["joint_graph"], call.arguments["score_mod_other_buffers"]
        if joint_graph is not None:  # None: no forward traced it (the kernel then traces it from the flags)
            call.arguments["score_mod_other_buffers"] = tuple(map(
                as_traced, captured, captured_tensors_given_a_gradient(joint_graph, len(captured))))
        return dense_backward(*call.args, **call.kwargs)

    monkeypatch.setitem(backward_op.py_kernels, key, backward)
    # the op keeps the kernel it resolved per dispatch key: a fresh cache now, the old one back at undo
    monkeypatch.setattr(backward_op, "_dispatch_cache", {})


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
    flex_backward_as_inductor_lowers_it(monkeypatch)
    if not hasattr(model_module, "_FLEX_KERNELS"):
        pytest.fail("model._FLEX_KERNELS is gone: give this test the new home of the compiled flex kernels")
    monkeypatch.setattr(model_module, "_FLEX_KERNELS", {})  # kernels compiled here, by the backend above
    torch._dynamo.reset()
    return checked
