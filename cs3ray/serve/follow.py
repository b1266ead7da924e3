"""Hot reload: watch a run for newer checkpoints and swap their weights into a live engine."""

from __future__ import annotations

import logging
import threading
from typing import Callable

import torch

from cs3ray.ckpt import load_for_inference, resolve_checkpoint
from cs3ray.errors import UserError
from cs3ray.models import Tokenizer, check_same

from .spec import ServeSpec

log = logging.getLogger(__name__)


class Follower:
    """A daemon thread that polls `spec.run` and calls swap(model, step) for each newer checkpoint.

    Only complete checkpoints (manifest written last, checksums verified on load) are ever
    seen, so a save in progress is never half-loaded; the engine applies the swap between two
    decode steps, so in-flight requests carry on with the new weights instead of being dropped.
    """

    def __init__(self, spec: ServeSpec, current_url: str, swap: Callable[[torch.nn.Module, int], None],
                 device: str, dtype: torch.dtype, tokenizer: Tokenizer | None = None) -> None:
        self.spec, self.current, self.swap = spec, current_url, swap
        self.tokenizer = tokenizer  # the engine decodes with it: weights of another tokenizer are not swapped in
        self.seen = current_url  # the newest checkpoint folder a poll has acted on
        self.device, self.dtype = device, dtype
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cs3-follow", daemon=True)
        self._thread.start()

    def poll(self) -> bool:
        """Load and swap in the run's newest good checkpoint when a new one appeared; True when it did."""
        newest = resolve_checkpoint(self.spec.run, self.spec.storage_options).url
        if newest == self.seen:
            return False
        self.seen = newest  # a damaged one is refused once (with its warning), not on every poll
        loaded = load_for_inference(self.spec.run, self.spec.storage_options, dtype=self.dtype,
                                    trust_code=self.spec.trust_code, replicas=self.spec.ckpt_replicas,
                                    stored_replicas=self.spec.stored_replicas)
        if loaded.url == self.current:
            return False
        if self.tokenizer is not None:
            check_same(loaded.tokenizer, self.tokenizer, f"checkpoint '{loaded.url}'", "the served model",
                       "restart the deployment to serve it")
        self.swap(loaded.model.to(self.device), loaded.step)
        self.current = loaded.url
        log.info("hot-reloaded %s (step %d)", loaded.url, loaded.step)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.spec.serve.follow_interval_s):
            try:
                self.poll()
            except (UserError, ValueError, OSError) as exc:
                # Keep serving the weights we have; the next poll may find a good checkpoint.
                log.warning("hot reload skipped: %s", exc)

    def stop(self) -> None:
        self._stop.set()
