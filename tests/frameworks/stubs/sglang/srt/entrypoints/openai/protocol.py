"""Stub of ``sglang.srt.entrypoints.openai.protocol``: ``Tool`` is imported by
miles/utils/chat_template_utils/{template,deepseek}.py (tool-call chat templates)."""

from _import_stub import stub_class

Tool = stub_class(__name__, "Tool")
