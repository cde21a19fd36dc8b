// support/placeholder.cc — keeps the test-support library non-empty until its first real file lands.
namespace epcomm::testing {
int support_placeholder() { return 0; }
}
