// Every malformed checkpoint input is refused with an absl::Status of the
// right code whose message names the file and, where there is one, the tensor
// or config field: safetensors images, config.json and generation_config.json,
// and whole model directories (single file and sharded).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/string_view.h"
#include "model/model.h"
#include "model/model_config.h"
#include "model/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"

namespace pdserve {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;

// Matches an absl::Status with `code` whose message satisfies `message`.
MATCHER_P2(IsError, code, message,
           absl::StrCat(negation ? "isn't" : "is", " a ", absl::StatusCodeToString(code),
                        " error whose message ",
                        ::testing::DescribeMatcher<std::string>(message))) {
  const absl::Status& status = arg;
  if (status.code() != code) {
    *result_listener << "has code " << absl::StatusCodeToString(status.code());
    return false;
  }
  return ::testing::ExplainMatchResult(message, std::string(status.message()), result_listener);
}

constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
constexpr absl::StatusCode kNotFound = absl::StatusCode::kNotFound;

// A fresh, empty directory for the running test.
fs::path FreshTestDir() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string leaf =
      absl::StrCat("pdserve_loader_errors_", info->test_suite_name(), "_", info->name());
  absl::StrReplaceAll({{"/", "_"}}, &leaf);
  const fs::path dir = fs::path(::testing::TempDir()) / leaf;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string ReadFile(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

void WriteFile(const fs::path& path, absl::string_view bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

// Replaces the one occurrence of `from` in the file with `to`.
void EditFile(const fs::path& path, const std::string& from, const std::string& to) {
  std::string text = ReadFile(path);
  const size_t at = text.find(from);
  ASSERT_NE(at, std::string::npos) << "'" << from << "' not in " << path;
  ASSERT_EQ(text.find(from, at + 1), std::string::npos) << "'" << from << "' twice in " << path;
  text.replace(at, from.size(), to);
  WriteFile(path, text);
}

fs::path FixtureDir(absl::string_view name) {
  return fs::path(PDSERVE_SOURCE_DIR) / "tests/fixtures/models" / std::string(name);
}

// ---------------------------------------------------------------------------
// Safetensors images.

constexpr char kFileName[] = "broken.safetensors";

// [u64 little-endian header length][header][data], the length taken from
// `header_len` when given (to lie about it).
std::string RawSafetensors(absl::string_view header, absl::string_view data = "",
                           std::optional<uint64_t> header_len = std::nullopt) {
  const uint64_t n = header_len.value_or(header.size());
  std::string out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  absl::StrAppend(&out, header, data);
  return out;
}

absl::Status ParseStatus(absl::string_view bytes) {
  return SafetensorsFile::Parse(bytes, kFileName).status();
}

// A header with the single tensor "w" described by `entry`.
std::string OneTensor(absl::string_view entry) { return absl::StrCat(R"({"w":)", entry, "}"); }

TEST(SafetensorsErrorsTest, EmptyFile) {
  EXPECT_THAT(ParseStatus(""),
              IsError(kInvalid, AllOf(HasSubstr(kFileName), HasSubstr("truncated"))));
}

TEST(SafetensorsErrorsTest, ShorterThanTheLengthPrefix) {
  EXPECT_THAT(ParseStatus(absl::string_view("\x10\x00\x00", 3)),
              IsError(kInvalid, AllOf(HasSubstr(kFileName), HasSubstr("3 bytes"))));
  EXPECT_THAT(ParseStatus(std::string(7, '\0')), IsError(kInvalid, HasSubstr(kFileName)));
}

TEST(SafetensorsErrorsTest, HeaderLengthPastTheEnd) {
  const std::string header = "{}";
  EXPECT_THAT(ParseStatus(RawSafetensors(header, "", header.size() + 1)),
              IsError(kInvalid, AllOf(HasSubstr(kFileName), HasSubstr("past the end"))));
  // A length that would wrap 8 + N around must not slip through either.
  EXPECT_THAT(ParseStatus(RawSafetensors(header, "", ~uint64_t{0})),
              IsError(kInvalid, AllOf(HasSubstr(kFileName), HasSubstr("past the end"))));
  EXPECT_THAT(ParseStatus(RawSafetensors(header, "", ~uint64_t{0} - 7)),
              IsError(kInvalid, HasSubstr(kFileName)));
}

TEST(SafetensorsErrorsTest, HeaderNotJson) {
  for (absl::string_view header : {"{not json", "", "{\"w\":", "\xff\xfe{}"}) {
    SCOPED_TRACE(header);
    EXPECT_THAT(ParseStatus(RawSafetensors(header)),
                IsError(kInvalid, AllOf(HasSubstr(kFileName), HasSubstr("not valid JSON"))));
  }
}

TEST(SafetensorsErrorsTest, HeaderNotAnObject) {
  for (absl::string_view header : {"[1, 2]", "42", "\"w\"", "null"}) {
    SCOPED_TRACE(header);
    EXPECT_THAT(ParseStatus(RawSafetensors(header)),
                IsError(kInvalid, AllOf(HasSubstr(kFileName), HasSubstr("not a JSON object"))));
  }
}

TEST(SafetensorsErrorsTest, EntryNotAnObject) {
  EXPECT_THAT(ParseStatus(RawSafetensors(OneTensor("[1]"))),
              IsError(kInvalid, AllOf(HasSubstr(kFileName), HasSubstr("'w'"))));
}

TEST(SafetensorsErrorsTest, EntryMissingAField) {
  const std::string data(8, '\0');
  struct Case {
    const char* entry;
    const char* field;
  };
  for (const Case& c : {
           Case{R"({"shape":[2],"data_offsets":[0,8]})", "dtype"},
           Case{R"({"dtype":"F32","data_offsets":[0,8]})", "shape"},
           Case{R"({"dtype":"F32","shape":[2]})", "data_offsets"},
           Case{R"({"dtype":7,"shape":[2],"data_offsets":[0,8]})", "dtype"},
           Case{R"({"dtype":"F32","shape":2,"data_offsets":[0,8]})", "shape"},
           Case{R"({"dtype":"F32","shape":[2],"data_offsets":[8]})", "data_offsets"},
           Case{R"({"dtype":"F32","shape":[2],"data_offsets":[0,4,8]})", "data_offsets"},
           Case{R"({"dtype":"F32","shape":[2],"data_offsets":"0-8"})", "data_offsets"},
       }) {
    SCOPED_TRACE(c.entry);
    EXPECT_THAT(ParseStatus(RawSafetensors(OneTensor(c.entry), data)),
                IsError(kInvalid,
                        AllOf(HasSubstr(kFileName), HasSubstr("tensor 'w'"), HasSubstr(c.field))));
  }
}

TEST(SafetensorsErrorsTest, BadShapeEntries) {
  const std::string data(8, '\0');
  for (absl::string_view shape : {"[-2]", "[2.0]", "[\"2\"]", "[null]", "[[2]]", "[2, -1]"}) {
    SCOPED_TRACE(shape);
    const std::string entry =
        absl::StrCat(R"({"dtype":"F32","shape":)", shape, R"(,"data_offsets":[0,8]})");
    EXPECT_THAT(ParseStatus(RawSafetensors(OneTensor(entry), data)),
                IsError(kInvalid,
                        AllOf(HasSubstr(kFileName), HasSubstr("tensor 'w'"), HasSubstr("shape"))));
  }
}

TEST(SafetensorsErrorsTest, BadDataOffsets) {
  const std::string data(16, '\0');
  EXPECT_THAT(ParseStatus(RawSafetensors(
                  OneTensor(R"({"dtype":"F32","shape":[1],"data_offsets":[8,4]})"), data)),
              IsError(kInvalid, AllOf(HasSubstr(kFileName), HasSubstr("tensor 'w'"),
                                      HasSubstr("begin 8 > end 4"))));
  for (absl::string_view offsets : {"[-4,0]", "[0,-4]", "[0.0,4]", "[0,\"4\"]"}) {
    SCOPED_TRACE(offsets);
    const std::string entry =
        absl::StrCat(R"({"dtype":"F32","shape":[1],"data_offsets":)", offsets, "}");
    EXPECT_THAT(ParseStatus(RawSafetensors(OneTensor(entry), data)),
                IsError(kInvalid, AllOf(HasSubstr(kFileName), HasSubstr("tensor 'w'"),
                                        HasSubstr("data_offsets"))));
  }
}

TEST(SafetensorsErrorsTest, OffsetsPastTheDataSection) {
  EXPECT_THAT(
      ParseStatus(RawSafetensors(OneTensor(R"({"dtype":"F32","shape":[4],"data_offsets":[0,16]})"),
                                 std::string(12, '\0'))),
      IsError(kInvalid,
              AllOf(HasSubstr(kFileName), HasSubstr("tensor 'w'"), HasSubstr("truncated"))));
  // Offsets near 2^64 must not wrap around.
  EXPECT_THAT(
      ParseStatus(RawSafetensors(
          OneTensor(
              R"({"dtype":"F32","shape":[1],"data_offsets":[18446744073709551612,18446744073709551615]})"),
          std::string(4, '\0'))),
      IsError(kInvalid, AllOf(HasSubstr(kFileName), HasSubstr("tensor 'w'"))));
}

// Two tensors written correctly, then the last bytes of the file cut off.
std::string TwoTensorImage() {
  const std::string a(4 * 6, '\x11'), b(4 * 4, '\x22');
  const TensorToWrite tensors[] = {{"first", DType::kF32, {2, 3}, a},
                                   {"second", DType::kF32, {4}, b}};
  return SerializeSafetensors(tensors);
}

TEST(SafetensorsErrorsTest, TruncatedImage) {
  const std::string whole = TwoTensorImage();
  ASSERT_TRUE(SafetensorsFile::Parse(whole, kFileName).ok());
  EXPECT_THAT(ParseStatus(absl::string_view(whole).substr(0, whole.size() - 4)),
              IsError(kInvalid, AllOf(HasSubstr(kFileName), HasSubstr("tensor 'second'"),
                                      HasSubstr("truncated"))));
}

TEST(SafetensorsErrorsTest, TruncatedFileOnDisk) {
  const fs::path path = FreshTestDir() / "model.safetensors";
  const std::string whole = TwoTensorImage();
  WriteFile(path, whole);
  ASSERT_TRUE(SafetensorsFile::Open(path.string()).ok());
  fs::resize_file(path, whole.size() - 4);
  EXPECT_THAT(SafetensorsFile::Open(path.string()).status(),
              IsError(kInvalid, AllOf(HasSubstr(path.string()), HasSubstr("tensor 'second'"),
                                      HasSubstr("truncated"))));
  // Cut inside the header: the length prefix now runs past the end.
  fs::resize_file(path, 12);
  EXPECT_THAT(SafetensorsFile::Open(path.string()).status(),
              IsError(kInvalid, AllOf(HasSubstr(path.string()), HasSubstr("past the end"))));
  fs::resize_file(path, 0);
  EXPECT_THAT(SafetensorsFile::Open(path.string()).status(),
              IsError(kInvalid, AllOf(HasSubstr(path.string()), HasSubstr("truncated"))));
}

TEST(SafetensorsErrorsTest, MissingFileOnDisk) {
  const std::string path = (FreshTestDir() / "absent.safetensors").string();
  EXPECT_THAT(SafetensorsFile::Open(path).status(), IsError(kNotFound, HasSubstr(path)));
}

TEST(SafetensorsErrorsTest, DirectoryInsteadOfFile) {
  const fs::path dir = FreshTestDir();
  EXPECT_THAT(SafetensorsFile::Open(dir.string()).status(),
              IsError(kInvalid, HasSubstr(dir.string())));
}

TEST(SafetensorsErrorsTest, ShapeDisagreesWithOffsetSpan) {
  const std::string data(16, '\0');
  EXPECT_THAT(ParseStatus(RawSafetensors(
                  OneTensor(R"({"dtype":"F32","shape":[3],"data_offsets":[0,8]})"), data)),
              IsError(kInvalid, AllOf(HasSubstr(kFileName), HasSubstr("tensor 'w'"),
                                      HasSubstr("needs 12 bytes"), HasSubstr("span 8"))));
  EXPECT_THAT(ParseStatus(RawSafetensors(
                  OneTensor(R"({"dtype":"BF16","shape":[2,2],"data_offsets":[0,16]})"), data)),
              IsError(kInvalid, AllOf(HasSubstr("tensor 'w'"), HasSubstr("needs 8 bytes"))));
  // Dimensions whose product overflows 64 bits must not wrap to a small size.
  EXPECT_THAT(
      ParseStatus(RawSafetensors(
          OneTensor(
              R"({"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]})"),
          data)),
      IsError(kInvalid, AllOf(HasSubstr(kFileName), HasSubstr("tensor 'w'"))));
  EXPECT_THAT(
      ParseStatus(RawSafetensors(
          OneTensor(R"({"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,4]})"),
          data)),
      IsError(kInvalid, AllOf(HasSubstr(kFileName), HasSubstr("tensor 'w'"))));
}

TEST(SafetensorsErrorsTest, UnsupportedDtype) {
  const std::string data(16, '\0');
  for (absl::string_view dtype : {"F64", "I8", "U8", "I64", "F8_E4M3", "BOOL", "f32", ""}) {
    SCOPED_TRACE(dtype);
    const std::string entry =
        absl::StrCat(R"({"dtype":")", dtype, R"(","shape":[2],"data_offsets":[0,16]})");
    EXPECT_THAT(
        ParseStatus(RawSafetensors(OneTensor(entry), data)),
        IsError(kInvalid, AllOf(HasSubstr(kFileName), HasSubstr("tensor 'w'"),
                                HasSubstr(absl::StrCat("unsupported dtype '", dtype, "'")))));
  }
}

TEST(SafetensorsErrorsTest, OverlappingTensors) {
  const std::string data(12, '\0');
  const std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  EXPECT_THAT(ParseStatus(RawSafetensors(header, data)),
              IsError(kInvalid, AllOf(HasSubstr(kFileName), HasSubstr("'a'"), HasSubstr("'b'"),
                                      HasSubstr("overlap"))));
  const std::string same_bytes = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                 R"("b":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]}})";
  EXPECT_THAT(ParseStatus(RawSafetensors(same_bytes, data)),
              IsError(kInvalid, AllOf(HasSubstr(kFileName), HasSubstr("overlap"))));
}

TEST(SafetensorsRoundTripTest, SerializeThenParseGivesTheSameTensors) {
  std::string f32(4 * 6, '\0'), f16(2 * 5, '\0'), bf16(2 * 2 * 2 * 2, '\0'), scalar(4, '\0');
  for (size_t i = 0; i < f32.size(); ++i) f32[i] = static_cast<char>(i * 7 + 1);
  for (size_t i = 0; i < f16.size(); ++i) f16[i] = static_cast<char>(200 - i);
  for (size_t i = 0; i < bf16.size(); ++i) bf16[i] = static_cast<char>(i ^ 0x5a);
  const float pi = 3.25f;
  std::memcpy(scalar.data(), &pi, sizeof(pi));
  const std::vector<TensorToWrite> tensors = {
      {"model.embed_tokens.weight", DType::kF32, {2, 3}, f32},
      {"empty", DType::kF32, {0, 4}, ""},
      {"h16", DType::kF16, {5}, f16},
      {"layers.0.b", DType::kBF16, {2, 2, 2}, bf16},
      {"scalar", DType::kF32, {}, scalar},
  };
  const std::string image = SerializeSafetensors(tensors);
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Parse(image, "rt");
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ((*file)->tensors().size(), tensors.size());
  EXPECT_EQ((*file)->Find("__metadata__"), nullptr);
  EXPECT_EQ((*file)->Find("absent"), nullptr);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorToWrite& want = tensors[i];
    SCOPED_TRACE(want.name);
    // Written back to back, so offset order is write order.
    EXPECT_EQ((*file)->tensors()[i].name, want.name);
    const TensorView* got = (*file)->Find(want.name);
    ASSERT_NE(got, nullptr);
    EXPECT_EQ(got->dtype, want.dtype);
    EXPECT_EQ(got->shape, want.shape);
    EXPECT_EQ(got->num_bytes, want.data.size());
    EXPECT_EQ(static_cast<size_t>(got->NumElements()) * DTypeSize(got->dtype), got->num_bytes);
    EXPECT_EQ(absl::string_view(static_cast<const char*>(got->data), got->num_bytes), want.data);
  }
}

TEST(SafetensorsRoundTripTest, WriteThenOpenFromDisk) {
  const fs::path path = FreshTestDir() / "rt.safetensors";
  const std::string bytes(4 * 3, '\x3c');
  const TensorToWrite tensors[] = {{"t", DType::kF32, {3}, bytes}};
  ASSERT_TRUE(WriteSafetensors(path.string(), tensors).ok());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path.string());
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->path(), path.string());
  const TensorView* t = (*file)->Find("t");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(absl::string_view(static_cast<const char*>(t->data), t->num_bytes), bytes);
}

// ---------------------------------------------------------------------------
// config.json and generation_config.json.

constexpr char kConfigSource[] = "some/model/config.json";

struct Field {
  std::string key;
  std::string json;  // The value, as JSON text.
};

// A valid Llama config.json with `overrides` replacing (or, for new keys,
// added to) the defaults, and the keys in `drop` left out.
std::string ConfigJson(const std::vector<Field>& overrides = {},
                       const std::vector<std::string>& drop = {}) {
  std::vector<Field> fields = {
      {"architectures", R"(["LlamaForCausalLM"])"},
      {"vocab_size", "128"},
      {"hidden_size", "64"},
      {"intermediate_size", "96"},
      {"num_hidden_layers", "2"},
      {"num_attention_heads", "4"},
      {"num_key_value_heads", "2"},
      {"max_position_embeddings", "256"},
      {"rms_norm_eps", "1e-05"},
      {"rope_theta", "10000.0"},
      {"hidden_act", R"("silu")"},
      {"tie_word_embeddings", "true"},
      {"bos_token_id", "1"},
      {"eos_token_id", "2"},
  };
  for (const Field& o : overrides) {
    bool replaced = false;
    for (Field& f : fields) {
      if (f.key == o.key) {
        f.json = o.json;
        replaced = true;
      }
    }
    if (!replaced) fields.push_back(o);
  }
  std::string out = "{";
  for (const Field& f : fields) {
    if (std::find(drop.begin(), drop.end(), f.key) != drop.end()) continue;
    absl::StrAppend(&out, out.size() > 1 ? ",\n" : "\n", "  \"", f.key, "\": ", f.json);
  }
  return out + "\n}\n";
}

absl::Status ConfigStatus(absl::string_view text) {
  return ParseModelConfig(text, kConfigSource).status();
}

// The message of a refused field: names the file and the field.
auto NamesField(absl::string_view field) {
  return AllOf(HasSubstr(kConfigSource), HasSubstr(absl::StrCat("'", field, "'")));
}

TEST(ModelConfigErrorsTest, BaseConfigParses) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(ConfigJson(), kConfigSource);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, Architecture::kLlama);
  EXPECT_EQ(c->head_dim, 16);
  EXPECT_EQ(c->num_kv_heads, 2);
  EXPECT_EQ(c->eos_token_ids, std::vector<int32_t>{2});
}

TEST(ModelConfigErrorsTest, NotJson) {
  for (absl::string_view text : {"{", "", "{\"vocab_size\": 12,}", "\xc3\x28"}) {
    SCOPED_TRACE(text);
    EXPECT_THAT(ConfigStatus(text),
                IsError(kInvalid, AllOf(HasSubstr(kConfigSource), HasSubstr("not valid JSON"))));
  }
}

TEST(ModelConfigErrorsTest, NotAnObject) {
  for (absl::string_view text : {"[]", "3", "null", "\"config\""}) {
    SCOPED_TRACE(text);
    EXPECT_THAT(ConfigStatus(text),
                IsError(kInvalid, AllOf(HasSubstr(kConfigSource), HasSubstr("not a JSON object"))));
  }
}

TEST(ModelConfigErrorsTest, Architectures) {
  EXPECT_THAT(ConfigStatus(ConfigJson({{"architectures", R"(["GPT2LMHeadModel"])"}})),
              IsError(kInvalid, AllOf(NamesField("architectures"), HasSubstr("GPT2LMHeadModel"))));
  for (absl::string_view value :
       {R"([])", R"("LlamaForCausalLM")", R"(["LlamaForCausalLM", "MistralForCausalLM"])", "[7]"}) {
    SCOPED_TRACE(value);
    EXPECT_THAT(ConfigStatus(ConfigJson({{"architectures", std::string(value)}})),
                IsError(kInvalid, NamesField("architectures")));
  }
  EXPECT_THAT(ConfigStatus(ConfigJson({}, {"architectures"})),
              IsError(kInvalid, NamesField("architectures")));
}

TEST(ModelConfigErrorsTest, MissingRequiredSize) {
  for (const char* field : {"hidden_size", "vocab_size", "intermediate_size", "num_hidden_layers",
                            "num_attention_heads"}) {
    SCOPED_TRACE(field);
    EXPECT_THAT(ConfigStatus(ConfigJson({}, {field})),
                IsError(kInvalid, AllOf(NamesField(field), HasSubstr("missing"))));
  }
}

TEST(ModelConfigErrorsTest, NonPositiveOrNonIntegerSizes) {
  EXPECT_THAT(ConfigStatus(ConfigJson({{"num_attention_heads", "-4"}})),
              IsError(kInvalid, AllOf(NamesField("num_attention_heads"), HasSubstr("positive"),
                                      HasSubstr("-4"))));
  EXPECT_THAT(ConfigStatus(ConfigJson({{"num_hidden_layers", "0"}})),
              IsError(kInvalid, NamesField("num_hidden_layers")));
  EXPECT_THAT(ConfigStatus(ConfigJson({{"hidden_size", "\"64\""}})),
              IsError(kInvalid, AllOf(NamesField("hidden_size"), HasSubstr("integer"))));
  EXPECT_THAT(ConfigStatus(ConfigJson({{"hidden_size", "64.5"}})),
              IsError(kInvalid, NamesField("hidden_size")));
  EXPECT_THAT(ConfigStatus(ConfigJson({{"rms_norm_eps", "-1e-5"}})),
              IsError(kInvalid, NamesField("rms_norm_eps")));
  EXPECT_THAT(ConfigStatus(ConfigJson({{"rope_theta", "\"big\""}})),
              IsError(kInvalid, NamesField("rope_theta")));
  EXPECT_THAT(ConfigStatus(ConfigJson({{"vocab_size", "4294967296"}})),
              IsError(kInvalid, NamesField("vocab_size")));
}

TEST(ModelConfigErrorsTest, KvHeadsMustDivideHeads) {
  EXPECT_THAT(ConfigStatus(ConfigJson({{"num_key_value_heads", "3"}})),
              IsError(kInvalid, AllOf(NamesField("num_key_value_heads"), HasSubstr("divide"))));
}

TEST(ModelConfigErrorsTest, HeadDim) {
  EXPECT_THAT(ConfigStatus(ConfigJson({{"head_dim", "15"}})),
              IsError(kInvalid, AllOf(NamesField("head_dim"), HasSubstr("even"))));
  // Derived as hidden_size / heads = 60 / 4 = 15.
  EXPECT_THAT(ConfigStatus(ConfigJson({{"hidden_size", "60"}})),
              IsError(kInvalid, AllOf(NamesField("head_dim"), HasSubstr("even"))));
  EXPECT_THAT(ConfigStatus(ConfigJson({{"hidden_size", "66"}})),
              IsError(kInvalid, AllOf(NamesField("head_dim"), HasSubstr("multiple"))));
  // An explicit head_dim makes a non-multiple hidden_size fine.
  absl::StatusOr<ModelConfig> c =
      ParseModelConfig(ConfigJson({{"hidden_size", "66"}, {"head_dim", "32"}}), kConfigSource);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 32);
}

TEST(ModelConfigErrorsTest, RopeScaling) {
  EXPECT_THAT(
      ConfigStatus(ConfigJson({{"rope_scaling", R"({"rope_type": "yarn", "factor": 4.0})"}})),
      IsError(kInvalid, AllOf(NamesField("rope_scaling.rope_type"), HasSubstr("yarn"))));
  EXPECT_THAT(ConfigStatus(ConfigJson({{"rope_scaling", R"({"type": "linear", "factor": 2.0})"}})),
              IsError(kInvalid, AllOf(NamesField("rope_scaling.rope_type"), HasSubstr("linear"))));
  EXPECT_THAT(ConfigStatus(ConfigJson({{"rope_scaling", R"({"factor": 2.0})"}})),
              IsError(kInvalid, NamesField("rope_scaling.rope_type")));
  EXPECT_THAT(ConfigStatus(ConfigJson({{"rope_scaling", "\"llama3\""}})),
              IsError(kInvalid, NamesField("rope_scaling")));
  EXPECT_THAT(ConfigStatus(ConfigJson({{"rope_scaling",
                                        R"({"rope_type": "llama3", "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192})"}})),
              IsError(kInvalid, AllOf(HasSubstr(kConfigSource), HasSubstr("rope_scaling"),
                                      HasSubstr("factor"))));
  EXPECT_THAT(
      ConfigStatus(ConfigJson({{"rope_scaling",
                                R"({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                    "high_freq_factor": 1.0,
                                    "original_max_position_embeddings": 8192})"}})),
      IsError(kInvalid, NamesField("rope_scaling.high_freq_factor")));
  EXPECT_THAT(
      ConfigStatus(ConfigJson({{"rope_scaling",
                                R"({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0})"}})),
      IsError(kInvalid,
              AllOf(HasSubstr(kConfigSource), HasSubstr("original_max_position_embeddings"))));

  absl::StatusOr<ModelConfig> llama3 = ParseModelConfig(
      ConfigJson({{"rope_scaling", R"({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192})"}}),
      kConfigSource);
  ASSERT_TRUE(llama3.ok()) << llama3.status();
  ASSERT_TRUE(llama3->rope_scaling.has_value());
  EXPECT_EQ(llama3->rope_scaling->factor, 8.0);
  EXPECT_TRUE(
      ParseModelConfig(ConfigJson({{"rope_scaling", R"({"rope_type": "default"})"}}), kConfigSource)
          .ok());
  EXPECT_TRUE(ParseModelConfig(ConfigJson({{"rope_scaling", "null"}}), kConfigSource).ok());
}

std::string MistralJson(absl::string_view sliding_window) {
  return ConfigJson({{"architectures", R"(["MistralForCausalLM"])"},
                     {"max_position_embeddings", "32768"},
                     {"sliding_window", std::string(sliding_window)}});
}

TEST(ModelConfigErrorsTest, MistralSlidingWindow) {
  EXPECT_THAT(ConfigStatus(MistralJson("4096")),
              IsError(kInvalid,
                      AllOf(NamesField("sliding_window"), HasSubstr("4096"), HasSubstr("32768"))));
  EXPECT_THAT(ConfigStatus(MistralJson("\"4096\"")),
              IsError(kInvalid, NamesField("sliding_window")));
  for (absl::string_view ok : {"null", "32768", "131072"}) {
    SCOPED_TRACE(ok);
    absl::StatusOr<ModelConfig> c = ParseModelConfig(MistralJson(ok), kConfigSource);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->architecture, Architecture::kMistral);
  }
}

TEST(ModelConfigErrorsTest, Qwen2SlidingWindow) {
  const std::string arch = R"(["Qwen2ForCausalLM"])";
  EXPECT_THAT(
      ConfigStatus(ConfigJson(
          {{"architectures", arch}, {"use_sliding_window", "true"}, {"sliding_window", "64"}})),
      IsError(kInvalid, NamesField("use_sliding_window")));
  // Qwen2 checkpoints carry a sliding_window that only matters when enabled.
  absl::StatusOr<ModelConfig> c = ParseModelConfig(
      ConfigJson(
          {{"architectures", arch}, {"use_sliding_window", "false"}, {"sliding_window", "64"}}),
      kConfigSource);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->qkv_bias);
}

TEST(ModelConfigErrorsTest, UnsupportedActivationAndBiases) {
  EXPECT_THAT(ConfigStatus(ConfigJson({{"hidden_act", "\"gelu\""}})),
              IsError(kInvalid, AllOf(NamesField("hidden_act"), HasSubstr("silu"))));
  EXPECT_THAT(ConfigStatus(ConfigJson({{"hidden_act", "1"}})),
              IsError(kInvalid, NamesField("hidden_act")));
  EXPECT_THAT(ConfigStatus(ConfigJson({{"attention_bias", "true"}})),
              IsError(kInvalid, NamesField("attention_bias")));
  EXPECT_THAT(ConfigStatus(ConfigJson({{"attention_bias", "\"no\""}})),
              IsError(kInvalid, NamesField("attention_bias")));
  EXPECT_THAT(ConfigStatus(ConfigJson({{"mlp_bias", "true"}})),
              IsError(kInvalid, NamesField("mlp_bias")));
  EXPECT_TRUE(ParseModelConfig(ConfigJson({{"attention_bias", "false"}, {"mlp_bias", "false"}}),
                               kConfigSource)
                  .ok());
}

TEST(ModelConfigErrorsTest, TokenIdsInConfig) {
  absl::StatusOr<ModelConfig> c =
      ParseModelConfig(ConfigJson({{"eos_token_id", "[2, 9]"}}), kConfigSource);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->eos_token_ids, (std::vector<int32_t>{2, 9}));
  EXPECT_THAT(ConfigStatus(ConfigJson({{"eos_token_id", "-1"}})),
              IsError(kInvalid, NamesField("eos_token_id")));
  EXPECT_THAT(ConfigStatus(ConfigJson({{"bos_token_id", "[\"<s>\"]"}})),
              IsError(kInvalid, NamesField("bos_token_id")));
}

constexpr char kGenSource[] = "some/model/generation_config.json";

TEST(GenerationConfigTest, EosAsIntAndAsList) {
  ModelConfig c;
  ASSERT_TRUE(ApplyGenerationConfig(R"({"eos_token_id": 7})", kGenSource, c).ok());
  EXPECT_EQ(c.eos_token_ids, std::vector<int32_t>{7});
  ASSERT_TRUE(
      ApplyGenerationConfig(R"({"eos_token_id": [7, 8, 128009], "bos_token_id": 5})", kGenSource, c)
          .ok());
  EXPECT_EQ(c.eos_token_ids, (std::vector<int32_t>{7, 8, 128009}));
  EXPECT_EQ(c.bos_token_id, 5);
  // Absent fields leave the config's values alone.
  ASSERT_TRUE(ApplyGenerationConfig(R"({"do_sample": true})", kGenSource, c).ok());
  EXPECT_EQ(c.eos_token_ids, (std::vector<int32_t>{7, 8, 128009}));
}

TEST(GenerationConfigTest, Errors) {
  ModelConfig c;
  for (absl::string_view text : {"{", "[]", ""}) {
    SCOPED_TRACE(text);
    EXPECT_THAT(ApplyGenerationConfig(text, kGenSource, c),
                IsError(kInvalid, HasSubstr(kGenSource)));
  }
  for (absl::string_view eos : {"-3", "\"</s>\"", "[1, -2]", "[1, [2]]", "2147483648", "1.5"}) {
    SCOPED_TRACE(eos);
    EXPECT_THAT(
        ApplyGenerationConfig(absl::StrCat(R"({"eos_token_id": )", eos, "}"), kGenSource, c),
        IsError(kInvalid, AllOf(HasSubstr(kGenSource), HasSubstr("'eos_token_id'"))));
  }
}

TEST(LoadModelConfigTest, MissingConfigIsNotFound) {
  const fs::path dir = FreshTestDir();
  const std::string path = (dir / "config.json").string();
  EXPECT_THAT(LoadModelConfig(dir.string()).status(), IsError(kNotFound, HasSubstr(path)));
  EXPECT_THAT(LoadModelConfig((dir / "no_such_dir").string()).status(),
              IsError(kNotFound, HasSubstr("no_such_dir/config.json")));
}

TEST(LoadModelConfigTest, GenerationConfigAppliedAndChecked) {
  const fs::path dir = FreshTestDir();
  WriteFile(dir / "config.json", ConfigJson());
  absl::StatusOr<ModelConfig> no_gen = LoadModelConfig(dir.string());
  ASSERT_TRUE(no_gen.ok()) << no_gen.status();
  EXPECT_EQ(no_gen->eos_token_ids, std::vector<int32_t>{2});

  WriteFile(dir / "generation_config.json", R"({"eos_token_id": [2, 3]})");
  absl::StatusOr<ModelConfig> with_gen = LoadModelConfig(dir.string());
  ASSERT_TRUE(with_gen.ok()) << with_gen.status();
  EXPECT_EQ(with_gen->eos_token_ids, (std::vector<int32_t>{2, 3}));

  WriteFile(dir / "generation_config.json", R"({"eos_token_id": "</s>"})");
  EXPECT_THAT(LoadModelConfig(dir.string()).status(),
              IsError(kInvalid, AllOf(HasSubstr((dir / "generation_config.json").string()),
                                      HasSubstr("'eos_token_id'"))));

  WriteFile(dir / "config.json", ConfigJson({{"hidden_act", "\"gelu\""}}));
  EXPECT_THAT(LoadModelConfig(dir.string()).status(),
              IsError(kInvalid,
                      AllOf(HasSubstr((dir / "config.json").string()), HasSubstr("'hidden_act'"))));
}

// ---------------------------------------------------------------------------
// Whole model directories.

struct OwnedTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

std::vector<OwnedTensor> ReadTensors(const fs::path& path) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path.string());
  EXPECT_TRUE(file.ok()) << file.status();
  std::vector<OwnedTensor> out;
  if (!file.ok()) return out;
  for (const TensorView& t : (*file)->tensors()) {
    out.push_back(
        {t.name, t.dtype, t.shape, std::string(static_cast<const char*>(t.data), t.num_bytes)});
  }
  return out;
}

void WriteTensors(const fs::path& path, const std::vector<OwnedTensor>& tensors) {
  std::vector<TensorToWrite> to_write;
  for (const OwnedTensor& t : tensors) to_write.push_back({t.name, t.dtype, t.shape, t.bytes});
  ASSERT_TRUE(WriteSafetensors(path.string(), to_write).ok());
}

class ModelLoadErrorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = FreshTestDir();
    dir_ = root_ / "model";
    absl::StatusOr<std::unique_ptr<kernels::cpu::CpuBackend>> backend =
        kernels::cpu::CpuBackend::Create({});
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
  }

  void CopyFixture(absl::string_view name) {
    fs::copy(FixtureDir(name), dir_, fs::copy_options::recursive);
    // Reference logits are not part of a checkpoint.
    fs::remove(dir_ / "reference_logits.json");
  }

  absl::Status Load() {
    return Model::Load(dir_.string(), ModelOptions{}, backend_.get()).status();
  }

  fs::path weights() const { return dir_ / "model.safetensors"; }

  // Rewrites model.safetensors after `edit` changed its tensor list.
  void EditWeights(const std::function<void(std::vector<OwnedTensor>&)>& edit) {
    std::vector<OwnedTensor> tensors = ReadTensors(weights());
    ASSERT_FALSE(tensors.empty());
    edit(tensors);
    WriteTensors(weights(), tensors);
  }

  fs::path root_;
  fs::path dir_;
  std::unique_ptr<kernels::cpu::CpuBackend> backend_;
};

TEST_F(ModelLoadErrorsTest, UnmodifiedCopyLoads) {
  CopyFixture("llama_tied_f32");
  EXPECT_EQ(Load(), absl::OkStatus());
  // Rewriting without changes must keep it loadable (guards the helpers).
  EditWeights([](std::vector<OwnedTensor>&) {});
  EXPECT_EQ(Load(), absl::OkStatus());
}

TEST_F(ModelLoadErrorsTest, MissingTensor) {
  CopyFixture("llama_tied_f32");
  const std::string name = "model.layers.1.mlp.up_proj.weight";
  EditWeights([&](std::vector<OwnedTensor>& tensors) {
    std::erase_if(tensors, [&](const OwnedTensor& t) { return t.name == name; });
  });
  EXPECT_THAT(Load(), IsError(kInvalid, AllOf(HasSubstr(dir_.string()), HasSubstr("missing tensor"),
                                              HasSubstr(absl::StrCat("'", name, "'")),
                                              HasSubstr("[96, 64]"))));
}

TEST_F(ModelLoadErrorsTest, MissingEmbedding) {
  CopyFixture("llama_tied_f32");
  EditWeights([](std::vector<OwnedTensor>& tensors) {
    std::erase_if(tensors,
                  [](const OwnedTensor& t) { return t.name == "model.embed_tokens.weight"; });
  });
  EXPECT_THAT(Load(), IsError(kInvalid, AllOf(HasSubstr(dir_.string()),
                                              HasSubstr("'model.embed_tokens.weight'"))));
}

TEST_F(ModelLoadErrorsTest, ExtraTensor) {
  CopyFixture("llama_tied_f32");
  EditWeights([](std::vector<OwnedTensor>& tensors) {
    tensors.push_back({"model.layers.0.bogus.weight", DType::kF32, {4}, std::string(16, '\0')});
  });
  EXPECT_THAT(Load(),
              IsError(kInvalid, AllOf(HasSubstr(weights().string()), HasSubstr("unexpected tensor"),
                                      HasSubstr("'model.layers.0.bogus.weight'"))));
}

TEST_F(ModelLoadErrorsTest, WrongShape) {
  CopyFixture("llama_tied_f32");
  // Same bytes, transposed shape: only the shape check can catch it.
  EditWeights([](std::vector<OwnedTensor>& tensors) {
    for (OwnedTensor& t : tensors) {
      if (t.name == "model.layers.0.self_attn.k_proj.weight") t.shape = {64, 32};
    }
  });
  EXPECT_THAT(Load(), IsError(kInvalid, AllOf(HasSubstr(weights().string()),
                                              HasSubstr("'model.layers.0.self_attn.k_proj.weight'"),
                                              HasSubstr("[64, 32]"), HasSubstr("[32, 64]"))));
}

TEST_F(ModelLoadErrorsTest, WrongEmbeddingShape) {
  CopyFixture("llama_tied_f32");
  EditWeights([](std::vector<OwnedTensor>& tensors) {
    for (OwnedTensor& t : tensors) {
      if (t.name == "model.embed_tokens.weight") t.shape = {64, 128};
    }
  });
  EXPECT_THAT(Load(), IsError(kInvalid, AllOf(HasSubstr("'model.embed_tokens.weight'"),
                                              HasSubstr("[64, 128]"), HasSubstr("[128, 64]"))));
}

TEST_F(ModelLoadErrorsTest, UnsupportedDtypeTensor) {
  CopyFixture("llama_tied_f32");
  // Same-length edit of one entry's dtype inside the header.
  std::string bytes = ReadFile(weights());
  const size_t key = bytes.find("\"model.norm.weight\":");
  ASSERT_NE(key, std::string::npos);
  const size_t dtype = bytes.find("\"dtype\":\"F32\"", key);
  ASSERT_NE(dtype, std::string::npos);
  ASSERT_LT(dtype, bytes.find('}', key));
  bytes.replace(dtype, 13, "\"dtype\":\"F64\"");
  WriteFile(weights(), bytes);
  EXPECT_THAT(Load(), IsError(kInvalid, AllOf(HasSubstr(weights().string()),
                                              HasSubstr("'model.norm.weight'"), HasSubstr("F64"))));
}

TEST_F(ModelLoadErrorsTest, TruncatedWeights) {
  CopyFixture("llama_tied_f32");
  fs::resize_file(weights(), fs::file_size(weights()) - 100);
  EXPECT_THAT(Load(),
              IsError(kInvalid, AllOf(HasSubstr(weights().string()), HasSubstr("truncated"))));
}

TEST_F(ModelLoadErrorsTest, NoWeightsFile) {
  CopyFixture("llama_tied_f32");
  fs::remove(weights());
  EXPECT_THAT(Load(),
              IsError(kNotFound, AllOf(HasSubstr(dir_.string()), HasSubstr("model.safetensors"))));
}

TEST_F(ModelLoadErrorsTest, NoConfig) {
  CopyFixture("llama_tied_f32");
  fs::remove(dir_ / "config.json");
  EXPECT_THAT(Load(), IsError(kNotFound, HasSubstr((dir_ / "config.json").string())));
}

TEST_F(ModelLoadErrorsTest, ConfigDisagreesWithWeights) {
  CopyFixture("llama_tied_f32");
  EditFile(dir_ / "config.json", "\"num_hidden_layers\": 2", "\"num_hidden_layers\": 3");
  EXPECT_THAT(Load(), IsError(kInvalid, HasSubstr("'model.layers.2.")));
  EditFile(dir_ / "config.json", "\"num_hidden_layers\": 3", "\"num_hidden_layers\": 1");
  EXPECT_THAT(Load(), IsError(kInvalid, AllOf(HasSubstr("unexpected tensor"),
                                              HasSubstr("'model.layers.1."))));
}

constexpr char kShard1[] = "model-00001-of-00002.safetensors";
constexpr char kShard2[] = "model-00002-of-00002.safetensors";

TEST_F(ModelLoadErrorsTest, ShardedUnmodifiedCopyLoads) {
  CopyFixture("llama_sharded_bf16");
  EXPECT_EQ(Load(), absl::OkStatus());
}

TEST_F(ModelLoadErrorsTest, IndexNamesMissingShardFile) {
  CopyFixture("llama_sharded_bf16");
  fs::remove(dir_ / kShard2);
  // A file the index names is absent, so NOT_FOUND naming that file.
  EXPECT_THAT(Load(), IsError(kNotFound, HasSubstr((dir_ / kShard2).string())));
}

TEST_F(ModelLoadErrorsTest, IndexListsTensorAbsentFromShard) {
  CopyFixture("llama_sharded_bf16");
  EditFile(
      dir_ / "model.safetensors.index.json", "\"weight_map\": {",
      absl::StrCat("\"weight_map\": {\n    \"model.layers.0.extra.weight\": \"", kShard1, "\","));
  EXPECT_THAT(Load(), IsError(kInvalid, AllOf(HasSubstr("model.safetensors.index.json"),
                                              HasSubstr("'model.layers.0.extra.weight'"),
                                              HasSubstr(kShard1))));
}

TEST_F(ModelLoadErrorsTest, ShardHoldsTensorTheIndexDoesNotList) {
  CopyFixture("llama_sharded_bf16");
  EditFile(dir_ / "model.safetensors.index.json",
           absl::StrCat("\"model.norm.weight\": \"", kShard2, "\",\n"), "");
  EXPECT_THAT(Load(), IsError(kInvalid, AllOf(HasSubstr((dir_ / kShard2).string()),
                                              HasSubstr("'model.norm.weight'"),
                                              HasSubstr("model.safetensors.index.json"))));
}

TEST_F(ModelLoadErrorsTest, IndexWithPathTraversal) {
  CopyFixture("llama_sharded_bf16");
  // A loadable file where the traversal would lead, so only the name check
  // can refuse it.
  const std::vector<OwnedTensor> shard2 = ReadTensors(dir_ / kShard2);
  WriteTensors(root_ / "x.safetensors", shard2);
  const fs::path index = dir_ / "model.safetensors.index.json";
  const std::string original = ReadFile(index);
  for (absl::string_view bad : {"../x.safetensors", "sub/../../x.safetensors", "..", ""}) {
    SCOPED_TRACE(bad);
    WriteFile(index, absl::StrReplaceAll(original, {{kShard2, bad}}));
    EXPECT_THAT(Load(),
                IsError(kInvalid, AllOf(HasSubstr(index.string()), HasSubstr("invalid file"),
                                        HasSubstr(absl::StrCat("'", bad, "'")))));
  }
  WriteFile(index, absl::StrReplaceAll(original, {{kShard2, (root_ / "x.safetensors").string()}}));
  EXPECT_THAT(Load(),
              IsError(kInvalid, AllOf(HasSubstr(index.string()), HasSubstr("invalid file"))));
}

TEST_F(ModelLoadErrorsTest, MalformedIndex) {
  CopyFixture("llama_sharded_bf16");
  const fs::path index = dir_ / "model.safetensors.index.json";
  WriteFile(index, "{\"weight_map\": ");
  EXPECT_THAT(Load(), IsError(kInvalid, HasSubstr(index.string())));
  WriteFile(index, R"({"metadata": {}})");
  EXPECT_THAT(Load(), IsError(kInvalid, AllOf(HasSubstr(index.string()), HasSubstr("weight_map"))));
  WriteFile(index, R"({"weight_map": {"model.norm.weight": 2}})");
  EXPECT_THAT(Load(), IsError(kInvalid,
                              AllOf(HasSubstr(index.string()), HasSubstr("'model.norm.weight'"))));
}

}  // namespace
}  // namespace pdserve
