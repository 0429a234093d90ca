"""Teacher-forced scoring, as the passkey and needle evaluators grade: one forward over prompt + answer,
and an answer span counts when the argmax at every one of its positions is its token."""

from dataclasses import dataclass, field

import numpy as np
import torch

from eval.loading import model_device
from eval.memory import plan_batch, stop_when_out_of_memory


@dataclass
class Sample:
    """One sequence to score: `tokens` is the model input plus the final answer token (so the input is
    tokens[:-1]); `spans` are [start, end) ranges of `tokens` that must all be predicted exactly."""

    tokens: np.ndarray
    spans: list
    meta: dict = field(default_factory=dict)


def predict_spans(model, samples, amp):
    """Teacher forcing: one forward over each full sequence, argmax at the positions that predict each
    span's tokens. Returns, per sample, a list of (correct, predicted token ids) per span. Only the last
    positions from the earliest span on get logits, never T x vocab."""
    length = len(samples[0].tokens) - 1
    first = min(start for s in samples for start, _ in s.spans)
    scored = length + 1 - first  # positions first-1 .. length-1 predict tokens first .. length
    device = model_device(model)
    x = torch.from_numpy(np.stack([s.tokens[:-1] for s in samples]).astype(np.int64)).to(device)
    with torch.no_grad(), amp:
        logits, _ = model(x, last_k=scored)
    preds = logits.argmax(dim=-1).cpu().numpy()
    out = []
    for sample, pred in zip(samples, preds):
        spans = []
        for start, end in sample.spans:
            guess = pred[start - first:end - first]
            spans.append((bool(np.array_equal(guess, sample.tokens[start:end])), guess.tolist()))
        out.append(spans)
    return out


def score_length(model, samples, batch_size, amp, bar=None):
    """predict_spans over all samples of one length in batches that fit. Raises OutOfMemory."""
    length = len(samples[0].tokens) - 1
    scored = length + 1 - min(start for s in samples for start, _ in s.spans)
    device = model_device(model)
    batch = plan_batch(model, min(batch_size, len(samples)), length, scored, device)
    results = []
    for i in range(0, len(samples), batch):
        chunk = samples[i:i + batch]
        with stop_when_out_of_memory(f"at length {length:,} with batch {len(chunk)}", device):
            results += predict_spans(model, chunk, amp)
        if bar is not None:
            bar.update(len(chunk))
    return results
