"""Models: loading (`pretrained`) and saving (`saving`), preparing one for its role (`prepare`),
LoRA and the shared base (`lora`), the reward model, the critic, the reference, the trunk/head
split and the scoring forwards (`trunk_head`), forward helpers (`forward`: shared prompts too,
`pair_row`), and the tiny models the tests and the demo build (`tiny`)."""
