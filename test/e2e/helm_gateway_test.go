package e2e

import (
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// TestHelmChartLeaseGateway checks what gateway.enabled renders
// (docs/guides/gateway.md), without a cluster: the listener's flags, the
// Pod its upstream tokens are bound to from the downward API, the signing
// CA mounted without enrollment, the port in the container, the Service
// and the NetworkPolicy, numeric ports on the node's network, and clear
// failures for a missing or colliding value.
func TestHelmChartLeaseGateway(t *testing.T) {
	t.Parallel()
	h := newHelm(t)
	help := run(t, tokenbrokerBinary(t), "serve", "--help")
	on := []string{
		"--set", "pki.tlsSecret=tls",
		"--set", "gateway.enabled=true",
		"--set", "gateway.url=https://tokenbroker.east.example:8445",
		"--set", "enrollment.caSecret=tokenbroker-ca",
	}
	with := func(set ...string) []string {
		args := append([]string{}, on...)
		for _, s := range set {
			args = append(args, "--set", s)
		}
		return args
	}
	container := func(t *testing.T, docs []manifest) corev1.Container {
		t.Helper()
		pod := decode[appsv1.Deployment](t, findManifest(t, docs, "Deployment", "tokenbroker")).Spec.Template.Spec
		require.Len(t, pod.Containers, 1)
		return pod.Containers[0]
	}
	tcp := ptrTo(corev1.ProtocolTCP)
	npPort := func(p int32) networkingv1.NetworkPolicyPort {
		return networkingv1.NetworkPolicyPort{Port: ptrTo(intstr.FromInt32(p)), Protocol: tcp}
	}

	t.Run("with the gateway on and enrollment off, the broker serves the gateway with the signing CA and binds no token to its Pod", func(t *testing.T) {
		docs := h.render(t, on...)
		d := decode[appsv1.Deployment](t, findManifest(t, docs, "Deployment", "tokenbroker"))
		ctr := container(t, docs)
		requireKnownServeFlags(t, ctr.Args, help)
		require.Subset(t, ctr.Args, []string{
			"--gateway-address=:8445",
			"--gateway-url=https://tokenbroker.east.example:8445",
			"--ca-cert-file=/etc/tokenbroker/ca/ca.crt",
			"--ca-key-file=/etc/tokenbroker/ca/ca.key",
		})
		for _, a := range ctr.Args {
			require.False(t, strings.HasPrefix(a, "--enroll-address"), "enrollment stays off: %s", a)
			require.False(t, strings.HasPrefix(a, "--gateway-max-conns"), "null caps keep the broker's defaults: %s", a)
			// A token bound to the broker's Pod is refused for a lease
			// ServiceAccount of another namespace: every request
			// answered 503 when the chart passed these.
			require.False(t, strings.HasPrefix(a, "--gateway-pod-"), "the gateway's tokens are bound to the lease Secret, not the Pod: %s", a)
		}

		env := map[string]corev1.EnvVar{}
		for _, e := range ctr.Env {
			env[e.Name] = e
		}
		// The kubelet expands $(VAR) only for a variable the container
		// defines; any other is passed on literally.
		for _, a := range ctr.Args {
			for _, m := range regexp.MustCompile(`\$\(([A-Z_]+)\)`).FindAllStringSubmatch(a, -1) {
				require.Contains(t, env, m[1], "%s names an env var of the container", a)
			}
		}

		ports := map[string]int32{}
		for _, p := range ctr.Ports {
			require.Equal(t, corev1.ProtocolTCP, p.Protocol)
			ports[p.Name] = p.ContainerPort
		}
		require.Equal(t, map[string]int32{"https": 8443, "gateway": 8445, "ops": 9090}, ports)

		require.Contains(t, ctr.VolumeMounts, corev1.VolumeMount{Name: "signing-ca", MountPath: "/etc/tokenbroker/ca", ReadOnly: true})
		require.Contains(t, d.Spec.Template.Spec.Volumes, corev1.Volume{Name: "signing-ca", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{
			SecretName:  "tokenbroker-ca",
			DefaultMode: ptrTo(int32(0o440)),
			Items:       []corev1.KeyToPath{{Key: "tls.crt", Path: "ca.crt"}, {Key: "tls.key", Path: "ca.key"}},
		}}})

		svc := decode[corev1.Service](t, findManifest(t, docs, "Service", "tokenbroker"))
		require.Equal(t, []corev1.ServicePort{
			{Name: "https", Port: 443, TargetPort: intstr.FromString("https"), Protocol: corev1.ProtocolTCP},
			{Name: "gateway", Port: 8445, TargetPort: intstr.FromString("gateway"), Protocol: corev1.ProtocolTCP},
		}, svc.Spec.Ports)
	})

	t.Run("the connection caps, the ports and a node port are values", func(t *testing.T) {
		docs := h.render(t, with(
			"gateway.maxConnsPerLease=16", "gateway.maxConnsPerPeer=256",
			"gateway.containerPort=9445", "gateway.servicePort=443", "service.port=8443",
			"service.type=NodePort", "service.nodePorts.gateway=30445",
			"networkPolicy.enabled=true",
		)...)
		ctr := container(t, docs)
		requireKnownServeFlags(t, ctr.Args, help)
		require.Subset(t, ctr.Args, []string{"--gateway-address=:9445", "--gateway-max-conns-per-lease=16", "--gateway-max-conns-per-peer=256"})
		require.Contains(t, ctr.Ports, corev1.ContainerPort{Name: "gateway", ContainerPort: 9445, Protocol: corev1.ProtocolTCP})
		svc := decode[corev1.Service](t, findManifest(t, docs, "Service", "tokenbroker"))
		require.Contains(t, svc.Spec.Ports, corev1.ServicePort{Name: "gateway", Port: 443, TargetPort: intstr.FromString("gateway"), NodePort: 30445, Protocol: corev1.ProtocolTCP})
		np := decode[networkingv1.NetworkPolicy](t, findManifest(t, docs, "NetworkPolicy", "tokenbroker"))
		require.Equal(t, []networkingv1.NetworkPolicyPort{npPort(8443), npPort(9445)}, np.Spec.Ingress[0].Ports, "the gateway is reached from where the API is")
	})

	t.Run("on the node's network the gateway's port is a number everywhere and the container declares none", func(t *testing.T) {
		docs := h.render(t, with(
			"hostNetwork=true", "containerPorts.https=18443", "containerPorts.ops=19090", "gateway.containerPort=18445",
			"networkPolicy.enabled=true",
		)...)
		ctr := container(t, docs)
		require.Empty(t, ctr.Ports)
		require.Contains(t, ctr.Args, "--gateway-address=:18445")
		svc := decode[corev1.Service](t, findManifest(t, docs, "Service", "tokenbroker"))
		require.Contains(t, svc.Spec.Ports, corev1.ServicePort{Name: "gateway", Port: 8445, TargetPort: intstr.FromInt32(18445), Protocol: corev1.ProtocolTCP})
		np := decode[networkingv1.NetworkPolicy](t, findManifest(t, docs, "NetworkPolicy", "tokenbroker"))
		require.Equal(t, []networkingv1.NetworkPolicyPort{npPort(18443), npPort(18445)}, np.Spec.Ingress[0].Ports)
	})

	t.Run("with the gateway off its values render nothing", func(t *testing.T) {
		off := h.render(t, "--set", "pki.tlsSecret=tls")
		valued := h.render(t, "--set", "pki.tlsSecret=tls", "--set", "gateway.url=https://tokenbroker.east.example:8445", "--set", "enrollment.caSecret=tokenbroker-ca")
		for _, kind := range []string{"Deployment", "Service"} {
			require.Equal(t, string(findManifest(t, off, kind, "tokenbroker").raw), string(findManifest(t, valued, kind, "tokenbroker").raw), kind)
		}
	})

	t.Run("without gateway.url rendering fails and says what to set", func(t *testing.T) {
		_, stderr, err := h.runErr("template", "tokenbroker", h.chart, "--set", "pki.tlsSecret=tls", "--set", "gateway.enabled=true", "--set", "enrollment.caSecret=tokenbroker-ca")
		require.Error(t, err)
		require.Contains(t, stderr, "gateway.url is required when gateway.enabled is true: the gateway's https://host[:port] as the peers reach it (--gateway-url")
	})

	t.Run("a missing CA, a colliding port or a URL the broker refuses fails rendering with a message naming the value", func(t *testing.T) {
		for _, tc := range []struct {
			set  []string
			want string
		}{
			{[]string{"enrollment.caSecret="}, "enrollment.caSecret is required when enrollment.enabled or gateway.enabled is true"},
			{[]string{"gateway.containerPort=8443"}, "gateway.containerPort must differ from containerPorts.https"},
			{[]string{"gateway.containerPort=9090"}, "gateway.containerPort must differ from containerPorts.https"},
			{[]string{"enrollment.enabled=true", "gateway.containerPort=8444"}, "gateway.containerPort must differ from containerPorts.https (the API), containerPorts.ops (the ops listener) and, with enrollment, enrollment.port"},
			{[]string{"gateway.servicePort=443"}, "gateway.servicePort must differ from service.port"},
			{[]string{"enrollment.enabled=true", "gateway.servicePort=8444"}, "gateway.servicePort must differ from service.port (the API) and, with enrollment, enrollment.servicePort"},
			{[]string{"gateway.url=http://tokenbroker.east.example:8445"}, "at '/gateway/url'"},
			{[]string{"gateway.url=https://tokenbroker.east.example:8445/gateway"}, "at '/gateway/url'"},
			{[]string{"gateway.maxConnsPerLease=0"}, "at '/gateway/maxConnsPerLease'"},
		} {
			_, stderr, err := h.runErr(append([]string{"template", "tokenbroker", h.chart}, with(tc.set...)...)...)
			require.Error(t, err, "%v", tc.set)
			require.Contains(t, stderr, tc.want, "%v", tc.set)
		}
	})
}
