"""Frontier: train language models from scratch under a fixed wall-clock budget."""


def load_for_eval(checkpoint_path, device="cpu"):
    """The competition's evaluation interface; see frontier.checkpoint.load_for_eval."""
    from frontier.checkpoint import load_for_eval as load

    return load(checkpoint_path, device)


__all__ = ["load_for_eval"]
