package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// The environment `make image-test` sets: the directory `make image` wrote
// and the reference it tagged.
const (
	imageDirEnv = "TOKENBROKER_IMAGE_DIR"
	imageRefEnv = "TOKENBROKER_IMAGE_REF"
)

// podman runs podman with its storage in a temporary directory, so that a
// test never touches the machine's images and containers.
type podman struct {
	bin    string
	global []string
	// ulimits for every container. Podman passes its own defaults (the
	// process's limits) to the runtime, and on machines whose hard limits a
	// container may not raise again (nested containers, hybrid cgroups)
	// runc then fails with "error setting rlimit"; explicit limits at or
	// below the current ones always work. Kubernetes leaves limits to the
	// container runtime, so these stand in for a node's defaults.
	ulimits []string
}

func newPodman(t *testing.T) *podman {
	t.Helper()
	bin, err := exec.LookPath("podman")
	require.NoError(t, err, "podman is needed (apt-get install podman runc; .ci/run installs them)")
	// Not t.TempDir(): podman refuses a runroot longer than 50 characters.
	dir, err := os.MkdirTemp("", "podman")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	p := &podman{
		bin: bin,
		global: []string{
			"--root", filepath.Join(dir, "storage"), "--runroot", filepath.Join(dir, "run"),
			"--tmpdir", filepath.Join(dir, "tmp"), "--cgroup-manager", "cgroupfs", "--events-backend", "file",
		},
	}
	// crun, podman's default runtime where it is installed, cannot create
	// containers on hosts with hybrid (v1 and v2) cgroups; runc can.
	runtimeName := os.Getenv("TOKENBROKER_PODMAN_RUNTIME")
	if runtimeName == "" {
		if _, err := exec.LookPath("runc"); err == nil {
			runtimeName = "runc"
		}
	}
	if runtimeName != "" {
		p.global = append(p.global, "--runtime", runtimeName)
	}
	nofile := 65536
	if out, err := exec.Command("sh", "-c", "ulimit -Hn").Output(); err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(out))); err == nil && n < nofile {
			nofile = n
		}
	}
	p.ulimits = []string{"--ulimit", fmt.Sprintf("nofile=%d:%d", nofile, nofile), "--ulimit", "nproc=4096:4096"}
	t.Cleanup(func() {
		// (Runs before the directory's removal.) Containers first, then the storage (its overlay mounts).
		_ = exec.Command(bin, append(p.global, "rm", "--all", "--force", "--time", "2")...).Run()
		_ = exec.Command(bin, append(p.global, "system", "reset", "--force")...).Run()
	})
	return p
}

func (p *podman) runErr(args ...string) (string, string, error) {
	return runErr(p.bin, append(p.global, args...)...)
}

func (p *podman) run(t *testing.T, args ...string) string {
	t.Helper()
	out, errOut, err := p.runErr(args...)
	require.NoError(t, err, "podman %s\nstdout: %s\nstderr: %s", strings.Join(args, " "), out, errOut)
	return out
}

// kubelet stands in for the kubelet of a node: it turns a rendered pod spec
// into `podman run` flags, with the volumes the pod mounts made from the
// Secrets and ConfigMaps given (the files' modes from the volume, their
// group the pod's fsGroup, as the kubelet sets them), the ServiceAccount
// token the kubelet would project, the environment, and the pod's and the
// container's security context. A security-context field it does not know
// fails the test, so that the chart cannot grow a setting the container
// test does not honour.
type kubelet struct {
	namespace  string
	secrets    map[string]map[string][]byte
	configMaps map[string]map[string]string
	// The projected ServiceAccount token and the API server the in-cluster
	// client reaches (KUBERNETES_SERVICE_HOST and _PORT).
	token   string
	caData  []byte
	apiHost string
	apiPort string
}

func (k kubelet) podmanArgs(t *testing.T, pod corev1.PodSpec) []string {
	t.Helper()
	require.Len(t, pod.Containers, 1)
	ctr := pod.Containers[0]
	psc, csc := pod.SecurityContext, ctr.SecurityContext
	require.NotNil(t, psc)
	require.NotNil(t, csc)
	requireOnlyFields(t, psc, "runAsNonRoot", "runAsUser", "runAsGroup", "fsGroup", "seccompProfile")
	requireOnlyFields(t, csc, "runAsNonRoot", "runAsUser", "runAsGroup", "readOnlyRootFilesystem", "allowPrivilegeEscalation", "capabilities", "seccompProfile")

	pick := func(c, p *int64) *int64 {
		if c != nil {
			return c
		}
		return p
	}
	uid, gid := pick(csc.RunAsUser, psc.RunAsUser), pick(csc.RunAsGroup, psc.RunAsGroup)
	require.NotNil(t, uid, "the pod must name its user: the image's is only checked by runAsNonRoot")
	require.NotNil(t, gid)
	nonRoot := csc.RunAsNonRoot
	if nonRoot == nil {
		nonRoot = psc.RunAsNonRoot
	}
	require.True(t, nonRoot != nil && *nonRoot, "runAsNonRoot")
	require.NotZero(t, *uid, "runAsNonRoot with runAsUser 0 would not start")

	args := []string{"--network", "host", "--user", fmt.Sprintf("%d:%d", *uid, *gid)}
	fsGroup := int64(0)
	if psc.FSGroup != nil {
		fsGroup = *psc.FSGroup
		args = append(args, "--group-add", strconv.FormatInt(fsGroup, 10))
	}
	seccomp := csc.SeccompProfile
	if seccomp == nil {
		seccomp = psc.SeccompProfile
	}
	require.NotNil(t, seccomp)
	switch seccomp.Type {
	case corev1.SeccompProfileTypeRuntimeDefault:
		// podman's default profile is the runtime default.
	case corev1.SeccompProfileTypeUnconfined:
		args = append(args, "--security-opt", "seccomp=unconfined")
	default:
		t.Fatalf("seccomp profile %q: the container test knows RuntimeDefault and Unconfined", seccomp.Type)
	}
	if csc.ReadOnlyRootFilesystem != nil && *csc.ReadOnlyRootFilesystem {
		// Without --read-only-tmpfs=false podman would add writable /tmp,
		// /var/tmp and /run, which a pod does not have.
		args = append(args, "--read-only", "--read-only-tmpfs=false")
	}
	if csc.AllowPrivilegeEscalation != nil && !*csc.AllowPrivilegeEscalation {
		args = append(args, "--security-opt", "no-new-privileges")
	}
	if c := csc.Capabilities; c != nil {
		for _, cap := range c.Drop {
			args = append(args, "--cap-drop", string(cap))
		}
		for _, cap := range c.Add {
			args = append(args, "--cap-add", string(cap))
		}
	}

	for _, e := range ctr.Env {
		switch {
		case e.ValueFrom == nil:
			args = append(args, "--env", e.Name+"="+e.Value)
		case e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "metadata.namespace":
			args = append(args, "--env", e.Name+"="+k.namespace)
		case e.ValueFrom.ResourceFieldRef != nil && e.ValueFrom.ResourceFieldRef.Resource == "limits.memory":
			// As the kubelet: the container's limit in bytes over the
			// divisor (default 1), rounded up.
			limit, ok := ctr.Resources.Limits[corev1.ResourceMemory]
			require.True(t, ok, "env %s: no memory limit to read", e.Name)
			divisor := int64(1)
			if d := e.ValueFrom.ResourceFieldRef.Divisor; !d.IsZero() {
				divisor = d.Value()
			}
			args = append(args, "--env", fmt.Sprintf("%s=%d", e.Name, (limit.Value()+divisor-1)/divisor))
		default:
			t.Fatalf("env %s: the container test knows values, metadata.namespace and limits.memory", e.Name)
		}
	}
	require.Empty(t, ctr.EnvFrom)

	volumes := map[string]corev1.Volume{}
	for _, v := range pod.Volumes {
		volumes[v.Name] = v
	}
	for _, m := range ctr.VolumeMounts {
		v, ok := volumes[m.Name]
		require.True(t, ok, "mount %s has no volume", m.Name)
		require.True(t, m.ReadOnly, "mount %s", m.Name)
		require.Empty(t, m.SubPath)
		dir := k.volume(t, v, fsGroup)
		args = append(args, "--volume", dir+":"+m.MountPath+":ro")
	}
	if pod.AutomountServiceAccountToken != nil && *pod.AutomountServiceAccountToken {
		dir := k.materialize(t, "serviceaccount", map[string][]byte{
			"token": []byte(k.token), "ca.crt": k.caData, "namespace": []byte(k.namespace),
		}, nil, 0o644, fsGroup)
		args = append(args, "--volume", dir+":/var/run/secrets/kubernetes.io/serviceaccount:ro",
			"--env", "KUBERNETES_SERVICE_HOST="+k.apiHost, "--env", "KUBERNETES_SERVICE_PORT="+k.apiPort)
	}
	return args
}

// volume writes a Secret or ConfigMap volume's files.
func (k kubelet) volume(t *testing.T, v corev1.Volume, fsGroup int64) string {
	t.Helper()
	switch {
	case v.Secret != nil:
		data, ok := k.secrets[v.Secret.SecretName]
		require.True(t, ok || (v.Secret.Optional != nil && *v.Secret.Optional), "Secret %s is not there", v.Secret.SecretName)
		return k.materialize(t, v.Name, data, v.Secret.Items, modeOf(v.Secret.DefaultMode, 0o644), fsGroup)
	case v.ConfigMap != nil:
		cm, ok := k.configMaps[v.ConfigMap.Name]
		require.True(t, ok, "ConfigMap %s is not there", v.ConfigMap.Name)
		data := map[string][]byte{}
		for key, val := range cm {
			data[key] = []byte(val)
		}
		return k.materialize(t, v.Name, data, v.ConfigMap.Items, modeOf(v.ConfigMap.DefaultMode, 0o644), fsGroup)
	default:
		t.Fatalf("volume %s: the container test knows Secret and ConfigMap volumes", v.Name)
		return ""
	}
}

func modeOf(m *int32, def os.FileMode) os.FileMode {
	if m == nil {
		return def
	}
	return os.FileMode(*m)
}

// materialize writes files as the kubelet does: every key (or the items
// chosen) with the volume's mode, owned by root and the pod's fsGroup.
func (k kubelet) materialize(t *testing.T, name string, data map[string][]byte, items []corev1.KeyToPath, mode os.FileMode, fsGroup int64) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), name)
	require.NoError(t, os.Mkdir(dir, 0o755))
	files := map[string][]byte{}
	if len(items) == 0 {
		files = data
	}
	for _, it := range items {
		b, ok := data[it.Key]
		require.True(t, ok, "volume %s: key %s is not there", name, it.Key)
		files[it.Path] = b
	}
	for path, b := range files {
		p := filepath.Join(dir, path)
		require.NoError(t, os.WriteFile(p, b, mode))
		require.NoError(t, os.Chmod(p, mode))
		require.NoError(t, os.Chown(p, 0, int(fsGroup)))
	}
	return dir
}

// requireOnlyFields fails when v sets a field other than those named.
func requireOnlyFields(t *testing.T, v any, known ...string) {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	var m map[string]any
	require.NoError(t, json.Unmarshal(b, &m))
	for _, k := range known {
		delete(m, k)
	}
	require.Empty(t, m, "security context fields the container test does not translate to podman")
}

// containerd starts a containerd of its own (state, storage and socket in a
// temporary directory, no CRI clients) and returns a function that runs ctr
// against it.
func startContainerd(t *testing.T) func(args ...string) (string, string, error) {
	t.Helper()
	bin, err := exec.LookPath("containerd")
	require.NoError(t, err, "containerd is needed (apt-get install containerd; .ci/run installs it)")
	ctr, err := exec.LookPath("ctr")
	require.NoError(t, err)
	// Not t.TempDir(): a unix socket path has at most 107 bytes.
	dir, err := os.MkdirTemp("", "ctrd")
	require.NoError(t, err)
	config := writeFile(t, filepath.Join(dir, "config.toml"), "version = 2\n")
	sock := filepath.Join(dir, "containerd.sock")
	cmd := exec.Command(bin, "--config", config, "--root", filepath.Join(dir, "root"), "--state", filepath.Join(dir, "state"), "--address", sock)
	var logs syncBuffer
	cmd.Stdout, cmd.Stderr = &logs, &logs
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		_ = exec.Command("umount", "-R", filepath.Join(dir, "root")).Run()
		_ = os.RemoveAll(dir)
	})
	require.Eventually(t, func() bool { _, err := os.Stat(sock); return err == nil }, 20*time.Second, 50*time.Millisecond, "containerd did not start:\n%s", logs.String())
	return func(args ...string) (string, string, error) {
		return runErr(ctr, append([]string{"--address", sock, "--namespace", "k8s.io"}, args...)...)
	}
}

// imageUnderTest returns the directory and reference of the image `make
// image` built, or skips when not run by `make image-test`.
func imageUnderTest(t *testing.T) (dir, ref, version string) {
	t.Helper()
	dir, ref = os.Getenv(imageDirEnv), os.Getenv(imageRefEnv)
	if dir == "" || ref == "" {
		t.Skipf("run by make image-test (after make image), which sets %s and %s", imageDirEnv, imageRefEnv)
	}
	// Not a skip: make image-test asked for this test.
	require.Zero(t, os.Geteuid(), "the container test runs rootful podman and writes volume files owned by the pod's fsGroup: run it as root")
	_, version, _ = strings.Cut(ref[strings.LastIndex(ref, "/")+1:], ":")
	return dir, ref, version
}

// TestImageRunsAsTheChartsDeployIt loads the image `make image` built into
// podman and runs it as the Helm charts deploy it: the container args,
// environment, mounts and security context are those the charts render
// (through kubelet above), so the manifests and the image cannot drift
// apart. The broker serves a kubeconfig over mutual TLS that kubectl uses;
// the agent, from the same image, enrolls with a join token and writes a
// Secret whose kubeconfig works too.
func TestImageRunsAsTheChartsDeployIt(t *testing.T) {
	dir, ref, version := imageUnderTest(t)
	pm := newPodman(t)
	archive := filepath.Join(dir, fmt.Sprintf("tokenbroker-%s-linux-%s.tar", version, runtime.GOARCH))
	out := pm.run(t, "load", "--input", archive)
	require.Contains(t, out, "Loaded image: "+ref)

	ociArchive := filepath.Join(dir, "tokenbroker-"+version+".oci.tar")

	t.Run("podman loads the multi-platform OCI archive under the same reference", func(t *testing.T) {
		out := pm.run(t, "load", "--input", ociArchive)
		require.Contains(t, out, "Loaded image: "+ref)
	})

	t.Run("containerd imports both archives as kind load image-archive does", func(t *testing.T) {
		ctr := startContainerd(t)
		for _, file := range []string{archive, ociArchive} {
			// kind load image-archive runs this on each node.
			stdout, stderr, err := ctr("images", "import", "--all-platforms", "--digests", file)
			require.NoError(t, err, "ctr import %s\nstdout: %s\nstderr: %s", file, stdout, stderr)
		}
		out, stderr, err := ctr("images", "ls", "--quiet")
		require.NoError(t, err, stderr)
		require.Contains(t, strings.Fields(out), ref)
		digest, err := os.ReadFile(filepath.Join(dir, "digest"))
		require.NoError(t, err)
		out, _, err = ctr("images", "ls")
		require.NoError(t, err)
		require.Contains(t, out, strings.TrimSpace(string(digest)), "the OCI archive imports the multi-platform index")
	})

	c := testcluster.Start(t)
	setUpTarget(t, c)
	ctx := context.Background()
	bin := tokenbrokerBinary(t)
	kubectl := kubectlBinary(t)
	admin := []string{"--kubeconfig", c.KubeconfigPath}
	work := t.TempDir()
	pkiDir := filepath.Join(work, "pki")
	run(t, bin, "pki", "init", "--dir", pkiDir)
	run(t, bin, "pki", "issue", "server", "--ca-dir", pkiDir, "--ip", "127.0.0.1", "--dns", "localhost")
	readPKI := func(name string) []byte {
		b, err := os.ReadFile(filepath.Join(pkiDir, name))
		require.NoError(t, err)
		return b
	}
	apiHost, apiPort, ok := strings.Cut(strings.TrimPrefix(c.URL, "https://"), ":")
	require.True(t, ok, c.URL)
	saToken := func(namespace, name string) string {
		exp := int64(3600)
		tr, err := c.Client.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, name,
			&authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{ExpirationSeconds: &exp}}, metav1.CreateOptions{})
		require.NoError(t, err)
		return tr.Status.Token
	}
	// applyRBAC applies what the chart renders for the ServiceAccount and
	// its RBAC, for real: the containers run with those permissions only.
	applyRBAC := func(docs []manifest) {
		var b strings.Builder
		for _, d := range docs {
			if d.Kind == "ServiceAccount" || strings.HasPrefix(d.Kind, "ClusterRole") || strings.HasPrefix(d.Kind, "Role") {
				b.WriteString("---\n")
				b.Write(d.raw)
			}
		}
		run(t, kubectl, append(admin, "apply", "-f", writeFile(t, filepath.Join(t.TempDir(), "rbac.yaml"), b.String()))...)
	}
	configMaps := func(docs []manifest) map[string]map[string]string {
		out := map[string]map[string]string{}
		for _, d := range manifestsOf(docs, "ConfigMap") {
			cm := decode[corev1.ConfigMap](t, d)
			out[cm.Name] = cm.Data
		}
		return out
	}
	for _, ns := range []string{"tokenbroker", "tokenbroker-agent"} {
		_, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
		require.NoError(t, err)
	}

	// The broker, from the broker's chart with enrollment on and free
	// container ports (host network).
	apiAddr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	opsAddr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	enrollPort := freePort(t)
	portOf := func(addr string) string { return addr[strings.LastIndex(addr, ":")+1:] }
	h := newHelm(t)
	values := writeFile(t, filepath.Join(work, "broker-values.yaml"), fmt.Sprintf(`pki:
  tlsSecret: tokenbroker-tls
enrollment:
  enabled: true
  caSecret: tokenbroker-ca
  port: %d
containerPorts:
  https: %s
  ops: %s
policy:
  cluster:
    name: east
    server: %s
  peers:
    - name: west
      identity: spiffe://e2e.example/cluster/west
      grants:
        - namespaces: [argo]
          serviceAccounts: [runner]
          maxTTL: 2h
`, enrollPort, portOf(apiAddr), portOf(opsAddr), c.URL))
	brokerDocs := h.render(t, "-f", values)
	applyRBAC(brokerDocs)
	brokerPod := decode[appsv1.Deployment](t, findManifest(t, brokerDocs, "Deployment", "tokenbroker")).Spec.Template.Spec
	require.Equal(t, ref, brokerPod.Containers[0].Image, "the chart deploys the image make image tags")
	brokerKubelet := kubelet{
		namespace: "tokenbroker",
		secrets: map[string]map[string][]byte{
			"tokenbroker-tls": {"tls.crt": readPKI("server.crt"), "tls.key": readPKI("server.key"), "ca.crt": readPKI("ca.crt")},
			"tokenbroker-ca":  {"tls.crt": readPKI("ca.crt"), "tls.key": readPKI("ca.key")},
		},
		configMaps: configMaps(brokerDocs),
		token:      saToken("tokenbroker", "tokenbroker"),
		caData:     c.CAData, apiHost: apiHost, apiPort: apiPort,
	}
	startContainer := func(name string, pod corev1.PodSpec, k kubelet, readyURL string) {
		args := append([]string{"run", "--detach", "--name", name}, pm.ulimits...)
		args = append(args, k.podmanArgs(t, pod)...)
		args = append(args, pod.Containers[0].Image)
		args = append(args, pod.Containers[0].Args...)
		require.Empty(t, pod.Containers[0].Command, "the image's entrypoint runs")
		pm.run(t, args...)
		deadline := time.Now().Add(60 * time.Second)
		for {
			resp, err := http.Get(readyURL)
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					return
				}
			}
			if time.Now().After(deadline) {
				logs, _, _ := pm.runErr("logs", name)
				state, _, _ := pm.runErr("inspect", "--format", "{{.State.Status}} exit={{.State.ExitCode}} {{.State.Error}}", name)
				t.Fatalf("%s not ready at %s within 60s (%v); state: %s\nlogs:\n%s", name, readyURL, err, state, logs)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	startContainer("tokenbroker", brokerPod, brokerKubelet, "http://"+opsAddr+"/readyz")

	t.Run("the container runs as 65532 with no capabilities, under seccomp, on a read-only root", func(t *testing.T) {
		top := pm.run(t, "top", "tokenbroker", "huser", "hgroup", "capeff", "seccomp")
		lines := strings.Split(strings.TrimSpace(top), "\n")
		require.Len(t, lines, 2, top)
		require.Equal(t, []string{"65532", "65532", "none", "filter"}, strings.Fields(lines[1]), top)
		require.Equal(t, "true", strings.TrimSpace(pm.run(t, "inspect", "--format", "{{.HostConfig.ReadonlyRootfs}}", "tokenbroker")))
	})

	t.Run("tokenbroker version in the container prints the commit it was built from", func(t *testing.T) {
		head := strings.TrimSpace(run(t, "git", "-C", repoRoot(t), "rev-parse", "HEAD"))
		out := pm.run(t, "exec", "tokenbroker", "tokenbroker", "version")
		require.Contains(t, out, "tokenbroker "+version)
		require.Contains(t, out, head)
	})

	t.Run("tokenbroker install copies the binary out of the image, as an init container does", func(t *testing.T) {
		out := t.TempDir()
		require.NoError(t, os.Chmod(out, 0o777)) // writable by 65532, as an emptyDir is
		args := append([]string{"run", "--rm", "--read-only", "--cap-drop", "ALL", "--user", "65532:65532"}, pm.ulimits...)
		pm.run(t, append(args, "-v", out+":/tokenbroker", ref, "install", "/tokenbroker")...)
		st, err := os.Stat(filepath.Join(out, "tokenbroker"))
		require.NoError(t, err)
		require.Equal(t, os.FileMode(0o755), st.Mode().Perm())
		if runtime.GOARCH == "amd64" {
			got := run(t, filepath.Join(out, "tokenbroker"), "version")
			require.Contains(t, got, "tokenbroker "+version, "the copy runs outside the image")
		}
	})

	westDir := filepath.Join(work, "west")
	require.NoError(t, os.Mkdir(westDir, 0o700))
	run(t, bin, "pki", "issue", "client", "--ca-dir", pkiDir, "--trust-domain", "e2e.example", "--cluster", "west",
		"--out-cert", filepath.Join(westDir, "west.crt"), "--out-key", filepath.Join(westDir, "west.key"))

	t.Run("curl gets a kubeconfig over mutual TLS and kubectl uses it", func(t *testing.T) {
		kc := filepath.Join(westDir, "east.kubeconfig")
		stdout, stderr, err := runErr("curl", "-sS", "--fail-with-body", "--cacert", filepath.Join(pkiDir, "ca.crt"),
			"--cert", filepath.Join(westDir, "west.crt"), "--key", filepath.Join(westDir, "west.key"),
			"-H", "Content-Type: application/json", "-H", "Accept: application/yaml",
			"-d", `{"namespace":"argo","serviceAccount":"runner","ttl":"1h"}`, "-o", kc, "https://"+apiAddr+"/v1/kubeconfigs")
		require.NoError(t, err, "stdout: %s\nstderr: %s", stdout, stderr)
		out := run(t, kubectl, "--kubeconfig", kc, "-n", "argo", "get", "configmap", "hello", "-o", "jsonpath={.data.k}")
		require.Equal(t, "v", out)
	})

	// The agent, from the agent's chart, enrolling with a join token at
	// the containerised broker and writing a Secret.
	tokenOut, stderr, err := runErr(bin, "pki", "join-token", "--ca-dir", pkiDir, "--trust-domain", "e2e.example", "--cluster", "west", "--audience", "east", "--ttl", "10m")
	require.NoError(t, err, stderr)
	fingerprint := fingerprintRE.FindString(stderr)
	require.NotEmpty(t, fingerprint, stderr)
	agentOps := freePort(t)
	ha := newHelm(t)
	ha.chart = filepath.Join(repoRoot(t), "deploy", "helm", "tokenbroker-agent")
	agentValues := writeFile(t, filepath.Join(work, "agent-values.yaml"), fmt.Sprintf(`containerPorts:
  ops: %d
config:
  identity:
    enroll:
      broker: https://127.0.0.1:%d
      caFingerprint: %s
  targets:
    - name: east
      broker: https://%s
      request: {namespace: argo, serviceAccount: runner, ttl: 1h}
      outputs:
        - secret: {namespace: argo, name: east, format: kubeconfig}
`, agentOps, enrollPort, fingerprint, apiAddr))
	agentDocs := ha.run(t, "template", "tokenbroker-agent", ha.chart, "--namespace", "tokenbroker-agent", "-f", agentValues)
	agentManifests := splitManifests(t, agentDocs)
	applyRBAC(agentManifests)
	agentPod := decode[appsv1.Deployment](t, findManifest(t, agentManifests, "Deployment", "tokenbroker-agent")).Spec.Template.Spec
	require.Equal(t, ref, agentPod.Containers[0].Image, "the agent's chart deploys the image make image tags")
	agentKubelet := kubelet{
		namespace:  "tokenbroker-agent",
		secrets:    map[string]map[string][]byte{"tokenbroker-agent-join": {"token": []byte(tokenOut)}},
		configMaps: configMaps(agentManifests),
		token:      saToken("tokenbroker-agent", "tokenbroker-agent"),
		caData:     c.CAData, apiHost: apiHost, apiPort: apiPort,
	}
	startContainer("tokenbroker-agent", agentPod, agentKubelet, fmt.Sprintf("http://127.0.0.1:%d/readyz", agentOps))

	t.Run("the agent enrolled, stored its identity and wrote a kubeconfig Secret that works", func(t *testing.T) {
		id, err := c.Client.CoreV1().Secrets("tokenbroker-agent").Get(ctx, "tokenbroker-agent-identity", metav1.GetOptions{})
		require.NoError(t, err)
		require.NotEmpty(t, id.Data["tls.crt"])
		var sec *corev1.Secret
		require.Eventually(t, func() bool {
			sec, err = c.Client.CoreV1().Secrets("argo").Get(ctx, "east", metav1.GetOptions{})
			return err == nil || !apierrors.IsNotFound(err)
		}, 10*time.Second, 100*time.Millisecond)
		require.NoError(t, err)
		kc := writeFile(t, filepath.Join(t.TempDir(), "east.kubeconfig"), string(sec.Data["kubeconfig"]))
		out := run(t, kubectl, "--kubeconfig", kc, "-n", "argo", "get", "configmap", "hello", "-o", "jsonpath={.data.k}")
		require.Equal(t, "v", out)
		var cfg map[string]any
		require.NoError(t, yaml.Unmarshal(sec.Data["kubeconfig"], &cfg))
	})
}
