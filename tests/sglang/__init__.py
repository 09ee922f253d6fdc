"""The rollout side inside SGLang (sglang_trace, the patch stack): SGLang's real modules on CPU with TRACE's plugin."""
