"""Stub of ``sglang.srt.entrypoints.openai``: miles' chat templates import the DeepSeek
encoding modules by name (used only for those models' chat templates):
``encoding_dsv4`` (miles/utils/chat_template_utils/deepseek.py:19, 2026-08) and
``encoding_dsv32`` (chat_template_utils/deepseek_v32.py:10, miles @d2c771bb5)."""

from _import_stub import stub_module

encoding_dsv4 = stub_module(__name__ + ".encoding_dsv4")
encoding_dsv32 = stub_module(__name__ + ".encoding_dsv32")
