"""DFlash drafters: model, loss, data and target code, single-process; `launcher` runs it."""
import logging


def _not_torchao_import_noise(record: logging.LogRecord) -> bool:
    """False for what importing torchao logs on every command (transformers imports it, with every
    quantizer): a warning per optional compiled extension of its wheel that cannot load here (`_C_mxfp8`,
    built for another Python; `_C_cutlass_90a`, CUDA only), which the fp8 path never uses, and torch's
    deprecation note per torchao enum it registers. Every other record, torchao's own included, passes."""
    message = record.getMessage()
    if record.name == "torchao":
        return not (message.startswith("Failed to load ") and "/torchao/_C" in message)
    enum = record.args[0] if isinstance(record.args, tuple) and record.args else None
    return not (getattr(enum, "__module__", "").startswith("torchao") and "register_constant()" in message)


logging.getLogger("torchao").addFilter(_not_torchao_import_noise)
logging.getLogger("torch.utils._pytree").addFilter(_not_torchao_import_noise)
