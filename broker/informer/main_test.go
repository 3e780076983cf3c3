package informer_test

import (
	"os"
	"testing"
)

// TestMain turns off client-go's streaming lists (the WatchListClient
// feature): client-go's fake clientsets cannot serve them, and a reflector
// that asks a fake for one waits forever for its closing bookmark (see
// broker/main_test.go).
func TestMain(m *testing.M) {
	if err := os.Setenv("KUBE_FEATURE_WatchListClient", "false"); err != nil {
		panic(err)
	}
	os.Exit(m.Run())
}
