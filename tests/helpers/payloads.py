"""Byte-level example batches of vLLM and SGLang releases (hex, byte by byte), decoded by
``tests/test_vllm.py`` and fed to the subscriber and the ingest path by their tests.

``EX_A_V033``: vLLM 0.33 (map events); ``EX_B_V023``: vLLM 0.23 (array events);
``EX_C_V092``: vLLM 0.9.2; ``EX_E_SGL0523`` / ``EX_E_SGL0516``: SGLang 0.5.23 (map events)
/ 0.5.16 (array events). ``tests/test_vllm.py`` checks each against the schema's encoder.
"""

from __future__ import annotations

from tests.helpers.publishers import hexbytes

EX_A_V033 = hexbytes("""
93 cb 41 d9 54 fc 40 20 00 00 92
84 a4 74 79 70 65 ac 42 6c 6f 63 6b 52 65 6d 6f 76 65 64
   ac 62 6c 6f 63 6b 5f 68 61 73 68 65 73 91 cf 88 77 66 55 44 33 22 11
   a6 6d 65 64 69 75 6d a3 47 50 55  a9 67 72 6f 75 70 5f 69 64 78 00
81 a4 74 79 70 65 b0 41 6c 6c 42 6c 6f 63 6b 73 43 6c 65 61 72 65 64
01""")

EX_B_V023 = hexbytes("""
93 cb 41 d9 54 fc 40 20 00 00 91
9c ab 42 6c 6f 63 6b 53 74 6f 72 65 64
92 cf 11 22 33 44 55 66 77 88 cf 88 77 66 55 44 33 22 11
c0 94 01 02 03 04 02 c0 a3 47 50 55 c0 92 c0 c0 00
ae 66 75 6c 6c 5f 61 74 74 65 6e 74 69 6f 6e c0 00""")

EX_C_V092 = hexbytes("""
93 cb 41 d9 54 fc 40 20 00 00 91 96 ab 42 6c 6f 63 6b 53 74 6f 72 65 64
92 cf 11 22 33 44 55 66 77 88 cf 88 77 66 55 44 33 22 11 c0 94 01 02 03 04 02 c0 00""")

EX_E_SGL0523 = hexbytes("""
93 cb 41 d9 54 fc 40 20 00 00 93
87 a4 "type" ab "BlockStored" ac "block_hashes" 91 fb  b1 "parent_block_hash" c0
   a9 "token_ids" 92 01 02  aa "block_size" 02  a7 "lora_id" c0  a6 "medium" a3 "GPU"
83 a4 "type" ac "BlockRemoved" ac "block_hashes" 91 fb  a6 "medium" a3 "GPU"
81 a4 "type" b0 "AllBlocksCleared"
00""")

EX_E_SGL0516 = hexbytes("""
93 cb 41 d9 54 fc 40 20 00 00 93 97 ab "BlockStored" 91 fb c0 92 01 02 02 c0 a3 "GPU"
93 ac "BlockRemoved" 91 fb a3 "GPU" 91 b0 "AllBlocksCleared" 00""")
