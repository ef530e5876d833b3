"""ggml graph operations, exported under their ggml names without the prefix.

These are the C functions themselves (no Python wrapper in between): the ml layer validates shapes
before calling them, because ggml aborts the process on a failed assertion.
"""

from . import lib

get_rows = lib.ggml_get_rows
set_rows = lib.ggml_set_rows
mul_mat = lib.ggml_mul_mat
mul_mat_id = lib.ggml_mul_mat_id
mul_mat_set_prec = lib.ggml_mul_mat_set_prec
mul_mat_set_hint = lib.ggml_mul_mat_set_hint
add = lib.ggml_add
add_id = lib.ggml_add_id
sub = lib.ggml_sub
mul = lib.ggml_mul
div = lib.ggml_div
scale = lib.ggml_scale
scale_bias = lib.ggml_scale_bias
rms_norm = lib.ggml_rms_norm
norm = lib.ggml_norm
l2_norm = lib.ggml_l2_norm
rope_ext = lib.ggml_rope_ext
rope_multi = lib.ggml_rope_multi
rope_set_offset = lib.ggml_rope_set_offset
soft_max_ext = lib.ggml_soft_max_ext
soft_max_add_sinks = lib.ggml_soft_max_add_sinks
flash_attn_ext = lib.ggml_flash_attn_ext
flash_attn_ext_set_prec = lib.ggml_flash_attn_ext_set_prec
flash_attn_ext_add_sinks = lib.ggml_flash_attn_ext_add_sinks
flash_attn_ext_get_prec = lib.ggml_flash_attn_ext_get_prec
swiglu = lib.ggml_swiglu
swiglu_split = lib.ggml_swiglu_split
swiglu_oai = lib.ggml_swiglu_oai
geglu = lib.ggml_geglu
geglu_split = lib.ggml_geglu_split
geglu_erf_split = lib.ggml_geglu_erf_split
glu = lib.ggml_glu
silu = lib.ggml_silu
gelu = lib.ggml_gelu
gelu_erf = lib.ggml_gelu_erf
gelu_quick = lib.ggml_gelu_quick
relu = lib.ggml_relu
sigmoid = lib.ggml_sigmoid
tanh = lib.ggml_tanh
exp = lib.ggml_exp
log = lib.ggml_log
floor = lib.ggml_floor
sqr = lib.ggml_sqr
sqrt = lib.ggml_sqrt
neg = lib.ggml_neg
clamp = lib.ggml_clamp
cpy = lib.ggml_cpy
cast = lib.ggml_cast
cont = lib.ggml_cont
cont_2d = lib.ggml_cont_2d
cont_3d = lib.ggml_cont_3d
cont_4d = lib.ggml_cont_4d
dup = lib.ggml_dup
view_1d = lib.ggml_view_1d
view_2d = lib.ggml_view_2d
view_3d = lib.ggml_view_3d
view_4d = lib.ggml_view_4d
reshape_1d = lib.ggml_reshape_1d
reshape_2d = lib.ggml_reshape_2d
reshape_3d = lib.ggml_reshape_3d
reshape_4d = lib.ggml_reshape_4d
permute = lib.ggml_permute
transpose = lib.ggml_transpose
concat = lib.ggml_concat
ssm_conv = lib.ggml_ssm_conv
ssm_scan = lib.ggml_ssm_scan
gated_delta_net = lib.ggml_gated_delta_net
softplus = lib.ggml_softplus
pad = lib.ggml_pad
conv_2d = lib.ggml_conv_2d
im2col = lib.ggml_im2col
pool_2d = lib.ggml_pool_2d
pad_ext = lib.ggml_pad_ext
argsort = lib.ggml_argsort
argsort_top_k = lib.ggml_argsort_top_k
top_k = lib.ggml_top_k
sum_rows = lib.ggml_sum_rows
sum = lib.ggml_sum
mean = lib.ggml_mean
repeat = lib.ggml_repeat
repeat_4d = lib.ggml_repeat_4d
arange = lib.ggml_arange
fill = lib.ggml_fill
new_graph_custom = lib.ggml_new_graph_custom
build_forward_expand = lib.ggml_build_forward_expand
graph_n_nodes = lib.ggml_graph_n_nodes
graph_node = lib.ggml_graph_node
graph_get_tensor = lib.ggml_graph_get_tensor

# enum values used as op arguments
PREC_F32 = lib.GGML_PREC_F32
HINT_SRC0_IS_HADAMARD = lib.GGML_HINT_SRC0_IS_HADAMARD
SORT_ASC = lib.GGML_SORT_ORDER_ASC
SORT_DESC = lib.GGML_SORT_ORDER_DESC
POOL_AVG = lib.GGML_OP_POOL_AVG
ROPE_TYPE_NORMAL = 0
ROPE_TYPE_NEOX = 2  # ggml.h #defines, which cffi cannot see
ROPE_TYPE_MROPE = 8
ROPE_TYPE_VISION = 24
ROPE_TYPE_IMROPE = 40
