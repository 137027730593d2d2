"""The drop-in ``nn.Module``s and what they are made of: KJT in, TorchRec's outputs out;
the prefetch queue, the pins of lookups awaiting backward, autograd, pooling."""
