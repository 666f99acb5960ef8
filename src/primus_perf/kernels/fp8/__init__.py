"""FP8 training GEMMs through torchao's float8 (an optional extra): the recipe table
(:mod:`.recipes`) and the two ways a layer runs FP8 (:mod:`.linear`): a weight the trainer
passes to ``dispatch.linear``, or an ``nn.Linear`` of any program."""
