"""The miniature Model Runner V2: input batch, tiny LoRA decoder, LoRA plumbing, CUDA graphs."""
