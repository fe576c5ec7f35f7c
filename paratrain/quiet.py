"""Third-party warnings that ask nothing of the person training, filtered once at `import paratrain` (every command,
and the ranks: their forkserver imports paratrain before forking them).

Each filter matches one message and says why it carries no action. A warning that could mean something for a run
stays visible; paratrain's own warnings are never filtered here.
"""

from __future__ import annotations

import logging
import warnings


class _DropMessages(logging.Filter):
    """Drops a logger's records whose message contains one of `texts`."""

    def __init__(self, *texts: str):
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in self.texts)


# torchao (the 8-bit optimizer states) tries its prebuilt CUDA kernels (mxfp8, CUTLASS for sm90a) at import and logs each
# one that does not load for this torch or machine. paratrain uses its 8-bit AdamW, which is plain PyTorch and needs
# none of them.
logging.getLogger("torchao").addFilter(_DropMessages("Failed to load"))

# torchao registers an Enum with torch's pytree at import, which torch 2.13 deprecates: torchao's to change, once per
# rank.
logging.getLogger("torch.utils._pytree").addFilter(_DropMessages("is an Enum subclass and is now natively supported"))

# torch's ShardedGradScaler (fp16 with FSDP, tp or pp) unscales DTensor gradients with its own shape-[1] scale and
# found-inf tensors; DTensor warns about them on every step. The scaler is torch's, and replicating them is what it
# means.
warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1 and ndim!=0", category=UserWarning)
