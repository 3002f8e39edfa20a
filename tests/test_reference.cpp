// placeholder: filled in by the test author
#include <gtest/gtest.h>
