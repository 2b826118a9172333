"""MusicNet audio LM: byte-level language modelling of quantised log-mel frames (the paper's v2).

The paper's v2 presents this as its positive case for scaled-exact Jordan-RoPE
of order three (copied from the paper; not measured here). Each WAV
becomes the byte 0 and then its 32-band log-mel frames (mono 16 kHz, the
first 10 s, hop 512, dB clipped to [-80, 0] and quantised to 0..255, one
byte per band; jrope/data/audio.py), a language model predicts the next
byte. The reference's medium MusicNet setting (configs/audio_lm_medium_musicnet.yaml):
d_model 192, 4 heads, 3 layers, MLP 2x, L = 256, batch 32, 300 steps,
AdamW 6e-4, weight decay 0.05; evaluation at 256, 512, 1024 on 64 fixed
windows per length (loss in nats per byte and bits per byte).

Data: MusicNet is not downloaded by jrope. Get musicnet.tar.gz from
https://zenodo.org/records/5120004 and prepare the tokens once from the
archive itself (needs pip install -e ".[train,audio]"):

    python -m jrope.data.audio --archive=musicnet.tar.gz --out_dir=data/musicnet_tokens --max_files=16

This is the reference's corpus: the archive's first 16 `.wav` members in
archive order. An unpacked folder (`--wav_dir=musicnet`) is read in sorted
path order, which picks other files (docs/reference.md); any folder of WAVs
works that way for other data. Without the prepared folder the
training command stops before compiling and says this.

Command (one method and seed per run; the reference's methods are rope,
damped_rope, direct_sum, jordan_rope, jordan_m3, jordan_m4,
jordan_exact_m3_c010_eta100_eta1, jordan_exact_m4_c010_eta100_eta1):

    python train.py --config=configs/audio_lm_musicnet.py \
        --workdir=runs/musicnet/jordan_exact_m3_c010_eta100_eta1/0
    python -m jrope.compare --config=configs/audio_lm_musicnet.py --seeds=0,1 \
        --methods=rope,damped_rope,direct_sum,jordan_rope,jordan_m3,jordan_m4,jordan_exact_m3_c010_eta100_eta1,jordan_exact_m4_c010_eta100_eta1 \
        --workdir=runs/musicnet

Hardware: one GPU or TPU host (batch 32 over 1, 2, 4, 8 devices); a 2-core
CPU runs it too, slowly.

Expected result: not measured with this code (MusicNet was not reachable
where jrope was developed). The paper reports scaled-exact order three
(jordan_exact_m3_c010_eta100_eta1) ahead of RoPE and the other orders here
(the paper's claim, copied; that it comes from this setting is read from the
reference's audio_lm_medium_musicnet.yaml: docs/reference.md, section 5).
"""

from configs import wikitext_scaled_exact

# The reference's MusicNet method list.
METHODS = (
    "rope",
    "damped_rope",
    "direct_sum",
    "jordan_rope",
    "jordan_m3",
    "jordan_m4",
    "jordan_exact_m3_c010_eta100_eta1",
    "jordan_exact_m4_c010_eta100_eta1",
)


def get_config():
    config = wikitext_scaled_exact.get_config()
    config.pe.name = "jordan_exact_m3_c010_eta100_eta1"  # scaled-exact, order 3, c 0.1, eta0 0.1
    config.data.source = "audio_tokens"  # token files of python -m jrope.data.audio
    config.data.path = "data/musicnet_tokens"  # the prepared folder (train.u8)
    config.data.eval_path = "data/musicnet_tokens"  # the prepared folder (eval.u8)
    config.model.d_model = 192
    config.model.num_heads = 4  # head_dim 48: 2m divides it for m = 2, 3, 4
    config.model.num_layers = 3
    config.model.mlp_ratio = 2
    config.pe.train_context = 256  # L (the data's seq_len too)
    config.batch_size = 32
    config.num_steps = 300
    config.opt.learning_rate = 6e-4
    config.opt.weight_decay = 0.05
    config.checkpoint.every_steps = 150
    config.eval.lengths = (256, 512, 1024)  # 1x .. 4x L
    config.eval.num_sequences = 64  # the reference's 16 batches of 4
    config.eval.batch_size = 4
    return config
