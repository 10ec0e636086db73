#!/usr/bin/env python3
"""Writes a vocab-only GGUF: the tokenizer, special tokens and chat template of a GGUF model
(every `tokenizer.*` key), no tensors. A config's `random = "..."` model takes its tokenizer
from such a file, so a speed run at a published model's size needs a few MB, not the weights.

Usage: scripts/make-vocab-gguf.py MODEL.gguf OUT.gguf   (needs the `gguf` package)
"""
import sys

from gguf import GGUFReader, GGUFValueType, GGUFWriter


def main(src: str, dst: str) -> None:
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    copied = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub_type)
        copied += 1
    if copied == 0:
        sys.exit(f"error: {src} has no tokenizer.* keys to copy")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"make-vocab-gguf: wrote {dst} ({copied} tokenizer keys from {src})")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: make-vocab-gguf.py MODEL.gguf OUT.gguf")
    main(sys.argv[1], sys.argv[2])
