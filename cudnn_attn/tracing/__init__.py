"""What traced calls run through (torch.compile, export, FakeTensor/meta, torch.func, autocast):
the ``torch.library`` custom ops, the call's constants as one JSON spec, the varlen/kvcache ops."""
