from tensorrt_llm._torch.auto_deploy.llm import LLM  # noqa: F401
