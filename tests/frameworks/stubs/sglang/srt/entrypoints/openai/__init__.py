"""Stub of ``sglang.srt.entrypoints.openai``: miles/utils/chat_template_utils/deepseek.py:19
imports the ``encoding_dsv4`` module by name (used only for DeepSeek-V4 chat templates)."""

from _import_stub import stub_module

encoding_dsv4 = stub_module(__name__ + ".encoding_dsv4")
