package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// execKubectl runs kubectl with extra environment (the plugin's cache
// directory, TOKENBROKER_* variables): kubectl passes its environment to
// the exec plugin. Its stderr, where the plugin's failures appear, joins
// the end-of-run scan for leaked tokens.
func execKubectl(kubectl string, env []string, args ...string) (string, string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, kubectl, args...)
	cmd.Env = slices.Concat(os.Environ(), env)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	errOut := stderr.String()
	collectLog("kubectl with tokenbroker credential (stderr)", func() string { return errOut })
	return stdout.String(), errOut, err
}

// cacheEntry is what the tests read of the plugin's cache file.
type cacheEntry struct {
	path      string
	LeaseID   string    `json:"leaseId"`
	RefreshAt time.Time `json:"refreshAt"`
	ExpiresAt time.Time `json:"expiresAt"`
}

// readCacheEntry reads the one cache file in dir.
func readCacheEntry(t *testing.T, dir string) cacheEntry {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.json"))
	require.NoError(t, err)
	require.Len(t, files, 1, "one cache file per request")
	data, err := os.ReadFile(files[0])
	require.NoError(t, err)
	var e cacheEntry
	require.NoError(t, json.Unmarshal(data, &e), "the cache file is JSON")
	e.path = files[0]
	return e
}

// TestExecCredentialPluginWithKubectl uses real kubectl with a kubeconfig
// from "tokenbroker get kubeconfig --exec" against a real kube-apiserver
// and broker: the cache, its lock, its refresh point, revocation, and
// broken or unsafe cache files, counting lease Secrets in the target.
func TestExecCredentialPluginWithKubectl(t *testing.T) {
	c := testcluster.Start(t)
	setUpTarget(t, c)
	e := startBroker(t, c)
	kubectl := kubectlBinary(t)
	bin := tokenbrokerBinary(t)
	api := "https://" + e.api
	identity := westIdentityDir(t, e)
	cacheHome := t.TempDir()
	cacheDir := filepath.Join(cacheHome, "tokenbroker")
	env := []string{"XDG_CACHE_HOME=" + cacheHome, "HOME=" + t.TempDir()}
	kc := filepath.Join(t.TempDir(), "east.kubeconfig")
	get := func(extraEnv ...string) (string, string, error) {
		return execKubectl(kubectl, slices.Concat(env, extraEnv), "--kubeconfig", kc, "get", "configmap", "hello", "-o", "jsonpath={.data.k}")
	}
	mustGet := func(t *testing.T) {
		t.Helper()
		out, stderr, err := get()
		require.NoError(t, err, stderr)
		require.Equal(t, "v", out)
		require.Empty(t, stderr, "the plugin says nothing when it works")
	}

	t.Run("get kubeconfig --exec revokes the lease it asked for and writes a kubeconfig that kubectl uses", func(t *testing.T) {
		_, stderr, err := runErr(bin, "get", "kubeconfig", "--exec", "--broker", api, "--identity-dir", identity,
			"--namespace", "argo", "--service-account", "runner", "--ttl", "1h", "-o", kc)
		require.NoError(t, err, stderr)
		require.Contains(t, stderr, "exec kubeconfig for argo/runner")
		data, err := os.ReadFile(kc)
		require.NoError(t, err)
		require.Contains(t, string(data), "command: "+bin)
		require.NotContains(t, string(data), "token:")
		require.Zero(t, countLeases(t, c), "the lease that showed the cluster is gone")

		mustGet(t)
		require.Equal(t, 1, countLeases(t, c))
		st, err := os.Stat(cacheDir)
		require.NoError(t, err)
		require.Equal(t, os.FileMode(0o700), st.Mode().Perm())
		entry := readCacheEntry(t, cacheDir)
		st, err = os.Stat(entry.path)
		require.NoError(t, err)
		require.Equal(t, os.FileMode(0o600), st.Mode().Perm())
		require.WithinDuration(t, entry.ExpiresAt.Add(-20*time.Minute-24*time.Second), entry.RefreshAt, 2*time.Second, "at 0.66 of the hour granted")

		mustGet(t)
		require.Equal(t, 1, countLeases(t, c), "the second kubectl used the cached token")
	})

	t.Run("twenty kubectl commands at once make exactly one lease", func(t *testing.T) {
		require.NoError(t, os.RemoveAll(cacheDir), "start cold")
		before := countLeases(t, c)
		var wg sync.WaitGroup
		errs := make([]error, 20)
		for i := range errs {
			wg.Go(func() {
				out, stderr, err := get()
				if err == nil && out != "v" {
					err = fmt.Errorf("got %q", out)
				}
				if err != nil {
					errs[i] = fmt.Errorf("%w: %s", err, stderr)
				}
			})
		}
		wg.Wait()
		for _, err := range errs {
			require.NoError(t, err)
		}
		require.Equal(t, before+1, countLeases(t, c))
	})

	t.Run("after the cached token's refresh point the next kubectl makes a new lease", func(t *testing.T) {
		// The refresh point is 40 minutes away: move it into the past in
		// the cache file, as time would.
		entry := readCacheEntry(t, cacheDir)
		data, err := os.ReadFile(entry.path)
		require.NoError(t, err)
		past := time.Now().Add(-time.Second).UTC().Format(time.RFC3339)
		data = bytes.Replace(data, []byte(`"refreshAt":"`+entry.RefreshAt.UTC().Format(time.RFC3339)+`"`), []byte(`"refreshAt":"`+past+`"`), 1)
		require.NoError(t, os.WriteFile(entry.path, data, 0o600))
		require.Equal(t, past, readCacheEntry(t, cacheDir).RefreshAt.UTC().Format(time.RFC3339))
		before := countLeases(t, c)

		mustGet(t)
		require.Equal(t, before+1, countLeases(t, c))
		require.NotEqual(t, entry.LeaseID, readCacheEntry(t, cacheDir).LeaseID)
		mustGet(t)
		require.Equal(t, before+1, countLeases(t, c))
	})

	t.Run("after a revocation the next kubectl fails once and the one after works", func(t *testing.T) {
		revoked := readCacheEntry(t, cacheDir).LeaseID
		status, body, err := e.curl(t, filepath.Join(e.dir, "west"), "-X", "DELETE", api+"/v1/leases/"+revoked)
		require.NoError(t, err)
		require.Equal(t, 204, status, body)
		start := time.Now()
		// The API server keeps accepting the token from its cache of
		// successful authentications for up to 10 s.
		var failures []string
		var succeeded int
		for readCacheEntry(t, cacheDir).LeaseID == revoked {
			require.Less(t, time.Since(start), 60*time.Second, "the revoked token was never refused")
			out, stderr, err := get()
			if err != nil {
				failures = append(failures, stderr)
			} else {
				require.Equal(t, "v", out)
				succeeded++
			}
		}
		t.Logf("the revoked token worked for %d more kubectl commands; the plugin replaced it %s after DELETE, in a kubectl that failed %d times",
			succeeded, time.Since(start).Round(100*time.Millisecond), len(failures))
		require.Len(t, failures, 1, "exactly one kubectl failed")
		require.Contains(t, failures[0], "Unauthorized")
		before := countLeases(t, c)
		mustGet(t)
		require.Equal(t, before, countLeases(t, c), "the fresh token was cached by the kubectl that failed")
	})

	t.Run("a corrupt cache file is replaced and kubectl works", func(t *testing.T) {
		entry := readCacheEntry(t, cacheDir)
		require.NoError(t, os.WriteFile(entry.path, []byte(`{"version":1,"token":`), 0o600))
		before := countLeases(t, c)
		mustGet(t)
		require.Equal(t, before+1, countLeases(t, c))
		require.NotEqual(t, entry.LeaseID, readCacheEntry(t, cacheDir).LeaseID)
	})

	t.Run("a world-readable cache file is refused with one clear line", func(t *testing.T) {
		entry := readCacheEntry(t, cacheDir)
		require.NoError(t, os.Chmod(entry.path, 0o644))
		_, stderr, err := get()
		require.Error(t, err)
		require.Contains(t, stderr, "tokenbroker credential: unsafe credential cache: the cache file "+entry.path+" has mode 0644")
		require.Contains(t, stderr, "delete it (rm "+entry.path+")")
		require.Equal(t, 1, strings.Count(stderr, "tokenbroker credential:"))
		require.NoError(t, os.Remove(entry.path))
		mustGet(t)
	})

	t.Run("TOKENBROKER_NO_CACHE=true asks the broker at every kubectl", func(t *testing.T) {
		before := countLeases(t, c)
		for range 2 {
			_, stderr, err := get("TOKENBROKER_NO_CACHE=true")
			require.NoError(t, err, stderr)
		}
		require.Equal(t, before+2, countLeases(t, c))
	})

	t.Run("run by hand, the plugin prints an ExecCredential, and names a broker that is down", func(t *testing.T) {
		args := []string{"credential", "--broker", api, "--identity-dir", identity, "--namespace", "argo", "--service-account", "runner",
			"--ttl", "1h", "--cache-dir", cacheDir}
		out, stderr, err := runErr(bin, args...)
		require.NoError(t, err, stderr)
		require.Empty(t, stderr)
		var cred struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
			Status     struct {
				Token               string    `json:"token"`
				ExpirationTimestamp time.Time `json:"expirationTimestamp"`
			} `json:"status"`
		}
		require.NoError(t, json.Unmarshal([]byte(out), &cred))
		require.Equal(t, "client.authentication.k8s.io/v1", cred.APIVersion)
		require.NotEmpty(t, cred.Status.Token)
		require.Equal(t, readCacheEntry(t, cacheDir).RefreshAt, cred.Status.ExpirationTimestamp, "the expiration is the cache's refresh point")

		down := fmt.Sprintf("https://127.0.0.1:%d", freePort(t))
		_, stderr, err = runErr(bin, "credential", "--broker", down, "--identity-dir", identity, "--namespace", "argo", "--service-account", "runner", "--no-cache")
		require.Error(t, err)
		require.Equal(t, 1, strings.Count(stderr, "\n"), "one line: %q", stderr)
		require.True(t, strings.HasPrefix(stderr, "tokenbroker credential: broker "+down+": "), stderr)
	})

	t.Run("the format=exec recipe of docs/api.md runs as printed: an exec kubeconfig from curl, the plugin from the PATH", func(t *testing.T) {
		dir := t.TempDir()
		copyPeerFiles(t, e, dir)
		require.NoError(t, os.CopyFS(filepath.Join(dir, "west-identity"), os.DirFS(identity)))
		before := countLeases(t, c)
		script := strings.ReplaceAll(fencedBlock(t, readDoc(t, "docs/api.md"), "sh", "curl -sS --fail-with-body --cert west.crt --key west.key --cacert ca.crt -H 'Content-Type: application/json' -H 'Accept: application/yaml' -d '{\"namespace\":\"argo\",\"serviceAccount\":\"runner\",\"ttl\":\"2h\"}' 'https://broker.example:8443/v1/kubeconfigs?format=exec'"), "https://broker.example:8443", api)
		out := runShell(t, dir, kubectl, filepath.Join(dir, "unused"), "export XDG_CACHE_HOME="+t.TempDir()+"\n"+script)
		require.Contains(t, out, "hello", "kubectl listed the ConfigMaps through the plugin")
		data, err := os.ReadFile(filepath.Join(dir, "exec.kubeconfig"))
		require.NoError(t, err)
		require.Contains(t, string(data), "command: tokenbroker")
		require.NotContains(t, string(data), "token:")
		require.Equal(t, before+1, countLeases(t, c), "curl made no lease; the plugin made one")
	})

	t.Run("wall time of kubectl get: a static kubeconfig, the exec kubeconfig with a warm cache, and without a cache", func(t *testing.T) {
		static := filepath.Join(t.TempDir(), "static.kubeconfig")
		_, stderr, err := runErr(bin, "get", "kubeconfig", "--broker", api, "--identity-dir", identity,
			"--namespace", "argo", "--service-account", "runner", "--ttl", "1h", "-o", static)
		require.NoError(t, err, stderr)
		median := func(kubeconfig string, extraEnv ...string) time.Duration {
			var d []time.Duration
			for range 7 {
				start := time.Now()
				_, stderr, err := execKubectl(kubectl, slices.Concat(env, extraEnv), "--kubeconfig", kubeconfig, "get", "configmap", "hello", "-o", "name")
				d = append(d, time.Since(start))
				require.NoError(t, err, stderr)
			}
			sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
			return d[len(d)/2]
		}
		t.Logf("kubectl get configmap, median of 7: static kubeconfig %s, exec with a warm cache %s, exec with --no-cache (a new lease each) %s",
			median(static).Round(time.Millisecond), median(kc).Round(time.Millisecond), median(kc, "TOKENBROKER_NO_CACHE=true").Round(time.Millisecond))
	})
}

// TestExecCredentialGuideRunsAsWrittenAgainstMakeDev runs every ```sh
// block of docs/guides/kubectl.md, in order and as written but for the
// broker's port, in a directory laid out as the repository is after `make
// dev` (.dev/ from "tokenbroker dev", bin/ with tokenbroker and kubectl).
func TestExecCredentialGuideRunsAsWrittenAgainstMakeDev(t *testing.T) {
	binDir := filepath.Dir(tokenbrokerBinary(t))
	kubectlBinary(t) // bin/kubectl, which the guide runs
	localcluster := filepath.Join(binDir, "localcluster")
	if _, err := os.Stat(localcluster); err != nil {
		build := exec.Command("go", "build", "-o", localcluster, "./cmd/localcluster")
		build.Dir = filepath.Join(repoRoot(t), "test")
		out, err := build.CombinedOutput()
		require.NoError(t, err, string(out))
	}
	work := t.TempDir()
	require.NoError(t, os.Symlink(binDir, filepath.Join(work, "bin")))
	listen := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	cmd := exec.Command(localcluster, "--kubeconfig-out", filepath.Join(work, ".dev", "admin.kubeconfig"), "--",
		filepath.Join(binDir, "tokenbroker"), "dev", "--dir", filepath.Join(work, ".dev"),
		"--listen-address", listen, "--ops-address", fmt.Sprintf("127.0.0.1:%d", freePort(t)))
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	banner := &syncBuffer{}
	logs := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = banner, logs
	collectLog("dev ("+t.Name()+")", logs.String)
	require.NoError(t, cmd.Start())
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGINT)
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
		}
		if t.Failed() {
			t.Logf("dev logs:\n%s", logs.String())
		}
	})
	require.Eventually(t, func() bool { return strings.Contains(banner.String(), "Ctrl-C stops") }, 90*time.Second, 50*time.Millisecond,
		"tokenbroker dev never became ready")

	script := replaceAll(t, strings.Join(fencedBlocks(readDoc(t, "docs/guides/kubectl.md"), "sh"), ""),
		"https://127.0.0.1:8443", "https://"+listen)
	run := exec.Command("bash", "-c", "set -euo pipefail\n"+script)
	run.Dir = work
	run.Env = slices.Concat(os.Environ(), []string{"XDG_CACHE_HOME=" + filepath.Join(work, "cache"), "HOME=" + filepath.Join(work, "home")})
	start := time.Now()
	out, err := run.CombinedOutput()
	collectLog("the kubectl guide's commands", func() string { return string(out) })
	require.NoError(t, err, "%s\n%s", script, out)
	t.Logf("the guide's commands ran in %s", time.Since(start).Round(100*time.Millisecond))
	text := string(out)
	require.Contains(t, text, "exec kubeconfig for demo/demo")
	require.Equal(t, 20, strings.Count(text, "configmap/hello"), "twenty kubectl at once")
	t.Logf("the guide's output:\n%s", text)
	require.Regexp(t, `(?m)^1$`, text, "one lease for all of them")
	require.Contains(t, text, "refused once; the plugin has already cached a new token", "the first kubectl after the revocation fails")
	require.Contains(t, text, "Unauthorized")
}
