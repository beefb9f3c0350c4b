"""The trainer's recent weights by version, for the log-probs of rollouts under the weights
they were generated with (the off-policy correction's `o_t`, `algorithms.off_policy`).

Before each step the trainer remembers its current weights (a CPU copy) under their
version, keeping the newest `window`; a batch's rows are then computed version by version:
rows of the current version with the policy itself, older ones with a spare copy of the
policy loaded with that version's weights. Rows of a version no longer (or never, after a
restart) held fall back to the current weights and are counted.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch

from rft_hpc.batch.logprobs import token_logprobs
from rft_hpc.batch.tokens import TokenBatch


class PolicyVersions:
    """The newest `window` versions of `policy`'s weights, and log-probs under them."""

    def __init__(self, policy: torch.nn.Module, window: int) -> None:
        self.policy, self.window = policy, window
        self._states: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._spare: torch.nn.Module | None = None

    def remember(self, version: int) -> None:
        """Keep the policy's current weights as `version` (dropping the oldest beyond
        `window`)."""
        if self.window <= 0 or version in self._states:
            return
        self._states[version] = {k: v.detach().to("cpu", copy=True)
                                 for k, v in self.policy.state_dict().items()}
        while len(self._states) > self.window:
            self._states.popitem(last=False)

    @property
    def held(self) -> list[int]:
        """The versions held, oldest first."""
        return list(self._states)

    @torch.no_grad()
    def logprobs(self, tb: TokenBatch, versions: torch.Tensor, current: int,
                 temperature: float) -> tuple[torch.Tensor, int]:
        """Log-probs [B, T] (CPU) of `tb`'s trained targets (0 elsewhere), each under the
        weights of its version in `versions` ([B, T], or [B]: one per row; the policy's own
        weights for `current`), and how many rows fell back to the current weights for some
        of their tokens because that version is not held."""
        device = next(self.policy.parameters()).device
        out = torch.zeros(tb.targets.shape, dtype=torch.float32)
        if versions.dim() == 1:
            versions = versions[:, None].expand(tb.targets.shape)
        trained = tb.loss_mask > 0
        fallen = torch.zeros(len(versions), dtype=torch.bool)
        for version in sorted(set(versions[trained].tolist())):  # untrained tokens stay 0
            tokens = (versions == version) & trained
            rows = tokens.any(dim=1).nonzero().squeeze(1)
            model = self.policy
            if version != current:
                if version in self._states:
                    model = self._loaded(version)
                else:
                    fallen[rows] = True
            part = tb.select(rows)
            part = part.to(device) if device.type != "cpu" else part
            was_training = model.training
            model.eval()
            try:
                logp = token_logprobs(model, part, temperature).float().cpu()
            finally:
                model.train(was_training)
            out[rows] = torch.where(tokens[rows], logp, out[rows])
        return out, int(fallen.sum())

    def _loaded(self, version: int) -> torch.nn.Module:
        if self._spare is None:
            self._spare = copy.deepcopy(self.policy)
            for p in self._spare.parameters():
                p.requires_grad_(False)
        self._spare.load_state_dict(self._states[version])
        return self._spare

