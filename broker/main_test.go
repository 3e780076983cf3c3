package broker

import (
	"os"
	"testing"
)

// TestMain turns off client-go's streaming lists (the WatchListClient
// feature, on by default since client-go 0.35) for this package's tests:
// client-go's fake clientsets cannot serve them, and a reflector that asks
// a fake for one waits forever for its closing bookmark. The reflectors
// here are given typed getters (corev1client.SecretsGetter, …), through
// which the fakes' own opt-out (Clientset.IsWatchListSemanticsUnSupported)
// cannot be seen. Against a real API server the broker keeps client-go's
// default; test/integration and test/e2e run it that way on every
// supported Kubernetes release.
//
// It also writes the credential-id annotation on the request rather than
// after it (afteranswer.go): many tests add reactors to a fake clientset
// after an issuance, which races with a write still under way. The tests
// of the background write set it back for their broker.
func TestMain(m *testing.M) {
	if err := os.Setenv("KUBE_FEATURE_WatchListClient", "false"); err != nil {
		panic(err)
	}
	inBackground = func(f func()) { f() }
	os.Exit(m.Run())
}
