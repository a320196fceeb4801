"""The local launcher: a whole cluster on this machine (router + workers as processes), and which
GPU each worker gets."""
